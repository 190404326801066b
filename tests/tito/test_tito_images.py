"""Images through tito: loaded from data URLs and files, expanded once with the model's processor, sent to
the engine with the token ids as the engine's own processed features, checked against the engine's own
expansion, and kept in the trajectory.

The fast tests run over a fake engine that renders images the way vLLM does (placeholder lengths from the
model's processor); `test_tito_images_real_engine.py` runs the same path against a real vLLM server."""

from __future__ import annotations

import base64
import io

import httpx
import msgspec
import numpy as np
import pytest
from fake_engine import FakeEngine

from tito import Capture, ChatRenderer, ChatState, Generation, ImageSpan, Tito, Trajectory, create_app
from tito._images import ImageLayout, load_image


def png_data_url(width: int, height: int, colour=(200, 30, 30)) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), colour, np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def processor(tiny_vl_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_model_dir)


@pytest.fixture(scope="module")
def vl_renderer(processor):
    return ChatRenderer(processor.tokenizer, ImageLayout(processor))


class ExpandingEngine(FakeEngine):
    """The fake engine, rendering images as vLLM does: each placeholder's length from the model's
    processor, from the image bytes it was sent. `extra_tokens` makes it disagree with tito on purpose."""

    def __init__(self, processor, extra_tokens: int = 0) -> None:
        super().__init__(eos_id=processor.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.processor, self.extra_tokens = processor, extra_tokens
        self.render = self.features

    def features(self, body: dict) -> dict:
        from PIL import Image

        (turn,) = body["messages"]
        urls = [part["image_url"]["url"] for part in turn["content"]]
        images = [Image.open(io.BytesIO(load_image(url).data)) for url in urls]
        grid = self.processor.image_processor(images=images)["image_grid_thw"]
        lengths = [int(thw.prod()) // 4 + self.extra_tokens for thw in grid]
        return {
            "features": {
                "mm_hashes": {"image": [f"hash-{load_image(url).sha256}" for url in urls]},
                "mm_placeholders": {"image": [{"offset": 0, "length": length} for length in lengths]},
                "kwargs_data": {"image": [f"tensors-{i}" for i in range(len(urls))]},
            }
        }


@pytest.fixture
def vl_engine(processor):
    return ExpandingEngine(processor)


def vl_client(model_dir, engine: ExpandingEngine, tmp_path) -> tuple[Tito, httpx.AsyncClient]:
    tito = Tito(
        ["http://engine"],
        model_dir,
        served_model_name="tiny-vl",
        dump=tmp_path / "dump.jsonl",
        engine_transport=httpx.ASGITransport(app=engine.app),
    )
    transport = httpx.ASGITransport(app=create_app(tito))
    return tito, httpx.AsyncClient(transport=transport, base_url="http://tito")


def test_load_image_reads_data_urls_and_files_and_refuses_the_network(tmp_path):
    url = png_data_url(30, 20)
    image = load_image(url)
    assert (image.width, image.height, image.media_type) == (30, 20, "image/png")
    assert image.data_url == url
    path = tmp_path / "shape.png"
    path.write_bytes(image.data)
    assert load_image(str(path)).sha256 == load_image(f"file://{path}").sha256 == image.sha256
    for bad, says in [
        ("https://example.com/a.png", "never the network"),
        ("data:image/png,abc", "must be base64"),
        ("data:image/png;base64,@@@", "valid base64"),
        ("data:image/png;base64,AAAA", "not an image"),
        (str(tmp_path / "missing.png"), "does not exist"),
    ]:
        with pytest.raises(ValueError, match=says):
            load_image(bad)


def test_expansion_equals_the_processor_applied_to_the_whole_conversation(vl_renderer, processor):
    """tito renders the template once and expands each placeholder by the image's size; the reference is
    the processor run over the rendered text and the decoded images together."""
    from PIL import Image

    urls = [png_data_url(64, 80), png_data_url(200, 40, (0, 0, 255))]
    messages = [
        {"role": "user", "content": [image_part(urls[0]), {"type": "text", "text": "what colour"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, image_part(urls[1])]},
    ]
    prompt = ChatState().prompt(vl_renderer, [], messages, None)
    text = vl_renderer.render(messages, None, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(load_image(url).data)).convert("RGB") for url in urls]
    reference = processor(text=[text], images=images)
    assert prompt.token_ids == reference["input_ids"][0]
    pad = processor.image_token_id
    assert [(s.offset, s.length) for s in prompt.images] == _runs(reference["input_ids"][0], pad)
    assert [s.sha256 for s in prompt.images] == [load_image(url).sha256 for url in urls]


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for index, token_id in enumerate(ids):
        if token_id != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def test_a_continuation_appends_new_images_after_the_trace(vl_renderer):
    state, capture = ChatState(), Capture("s")
    first = [{"role": "user", "content": [image_part(png_data_url(56, 56)), {"type": "text", "text": "hi"}]}]
    prompt = state.prompt(vl_renderer, capture.tokens, first, None, capture.images)
    capture.commit_turn(prompt.token_ids, prompt.images, Generation([10, 11], [-1.0, -1.0]))
    reply = {"role": "assistant", "content": "ab"}
    state.record(first, None, prompt, reply, [])
    second = [*first, reply, {"role": "user", "content": [image_part(png_data_url(112, 112))]}]
    prompt2 = state.prompt(vl_renderer, capture.tokens, second, None, capture.images)
    assert prompt2.token_ids[: len(capture.tokens)] == capture.tokens
    assert prompt2.images[0] == prompt.images[0]
    assert prompt2.images[1].offset > len(capture.tokens) and prompt2.images[1].length == 16
    capture.commit_turn(prompt2.token_ids, prompt2.images, Generation([12], [-1.0]))
    (segment,) = capture.trajectory().segments
    assert segment.images == prompt2.images


def test_the_same_tokens_with_another_image_open_a_new_segment():
    capture = Capture("s")
    red = ImageSpan(1, 2, "a" * 64, "data:image/png;base64,")
    blue = ImageSpan(1, 2, "b" * 64, "data:image/png;base64,")
    capture.commit_turn([1, 6, 6, 2], [red], Generation([3], [-0.5]))
    capture.commit_turn([1, 6, 6, 2, 3, 4], [blue], Generation([5], [-0.5]))
    first, second = capture.trajectory().segments
    assert (first.images, second.images) == ([red], [blue])
    assert second.token_ids == [1, 6, 6, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        pytest.param(
            [
                {"role": "system", "content": [image_part(png_data_url(56, 56))]},
                {"role": "user", "content": "x"},
            ],
            "only be sent in user messages",
            id="image-in-system",
        ),
        pytest.param(
            [{"role": "user", "content": [image_part("https://example.com/a.png")]}],
            "never the network",
            id="remote-url",
        ),
        pytest.param(
            [
                {
                    "role": "user",
                    "content": [image_part(png_data_url(56, 56)), {"type": "text", "text": "<|image_pad|>"}],
                }
            ],
            "2 image placeholders for 1 images",
            id="placeholder-typed-as-text",
        ),
    ],
)
def test_images_the_renderer_refuses(vl_renderer, messages, says):
    with pytest.raises(ValueError, match=says):
        ChatState().prompt(vl_renderer, [], messages, None)


async def test_openai_and_anthropic_images_reach_the_engine_once_and_the_trajectory(
    tiny_vl_model_dir, vl_engine, tmp_path
):
    tito, client = vl_client(tiny_vl_model_dir, vl_engine, tmp_path)
    pad = vl_engine.processor.image_token_id
    session = (await client.post("/sessions")).json()
    url = png_data_url(64, 80)
    openai_body = {
        "model": "tiny-vl",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [image_part(url), {"type": "text", "text": "what"}]}],
    }
    reply = await client.post(f"/s/{session['id']}/v1/chat/completions", json=openai_body)
    assert reply.status_code == 200, reply.text
    sent = vl_engine.requests[-1]
    assert _runs(sent["token_ids"], pad) == [(4, 6)]  # tito's expanded prompt, as it is
    assert sent["features"] == {
        "mm_hashes": {"image": [f"hash-{load_image(url).sha256}"]},
        "mm_placeholders": {"image": [{"offset": 4, "length": 6}]},
        "kwargs_data": {"image": ["tensors-0"]},
    }

    first_image = {"type": "image", "source": {"type": "url", "url": url}}
    second_data = png_data_url(112, 56).split(",")[1]
    second_image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": second_data},
    }
    answer = reply.json()["choices"][0]["message"]["content"] or ""
    anthropic_body = {
        "model": "tiny-vl",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": [first_image, {"type": "text", "text": "what"}]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "text", "text": "and"}, second_image]},
        ],
    }
    reply = await client.post(f"/s/{session['id']}/v1/messages", json=anthropic_body)
    assert reply.status_code == 200, reply.text
    second = vl_engine.requests[-1]
    assert [p["length"] for p in second["features"]["mm_placeholders"]["image"]] == [6, 8]
    assert second["features"]["kwargs_data"] == {"image": ["tensors-0", "tensors-0"]}
    # The first image was processed once, for the first turn; the second turn rendered only the new one.
    rendered = [
        [p["image_url"]["url"] for p in body["messages"][0]["content"]] for body in vl_engine.rendered
    ]
    assert rendered == [[url], [f"data:image/png;base64,{second_data}"]]
    trajectory = (await client.delete(f"/sessions/{session['id']}")).json()
    (segment,) = trajectory["segments"]
    spans = [(image["offset"], image["length"]) for image in segment["images"]]
    assert spans == [(4, 6), (spans[1][0], 8)]
    assert _runs(segment["token_ids"], pad) == spans
    assert segment["images"][0]["data_url"] == url
    dumped = msgspec.json.decode((tmp_path / "dump.jsonl").read_bytes().splitlines()[0], type=Trajectory)
    assert dumped.segments[0].images == [ImageSpan(**image) for image in segment["images"]]
    await tito.aclose()


async def test_an_engine_that_expands_differently_fails_the_turn_loudly(
    tiny_vl_model_dir, processor, tmp_path
):
    engine = ExpandingEngine(processor, extra_tokens=1)
    tito, client = vl_client(tiny_vl_model_dir, engine, tmp_path)
    session = (await client.post("/sessions")).json()
    body = {
        "model": "tiny-vl",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [image_part(png_data_url(64, 80))]}],
    }
    reply = await client.post(f"/s/{session['id']}/v1/chat/completions", json=body)
    assert reply.status_code == 502
    assert "serve the engine and tito from the same model directory" in reply.json()["error"]["message"]
    await tito.aclose()


def test_a_sampled_placeholder_stops_the_conversation(vl_renderer):
    """The engine would put the next image on a placeholder the model sampled: refused, not misread."""
    state, capture = ChatState(), Capture("s")
    first = [{"role": "user", "content": [image_part(png_data_url(56, 56)), {"type": "text", "text": "hi"}]}]
    prompt = state.prompt(vl_renderer, capture.tokens, first, None, capture.images)
    sampled = Generation([10, vl_renderer.images.image_token_id], [-1.0, -1.0])
    capture.commit_turn(prompt.token_ids, prompt.images, sampled)
    reply = {"role": "assistant", "content": "a"}
    state.record(first, None, prompt, reply, [])
    second = [*first, reply, {"role": "user", "content": [image_part(png_data_url(56, 56))]}]
    with pytest.raises(ValueError, match="holds an image placeholder token the model sampled"):
        state.prompt(vl_renderer, capture.tokens, second, None, capture.images)
