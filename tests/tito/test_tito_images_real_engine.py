"""Multi-turn image episodes through tito in front of a real vLLM (CPU build) server on the tiny Qwen2-VL,
with the real openai and anthropic SDK clients. Every turn with images is checked by tito against the
engine's own expansion (a mismatch would fail the request); here the result is also compared with vLLM
rendering the same conversation itself."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from test_tito_images import image_part, png_data_url

pytestmark = pytest.mark.slow


def _image_runs(segment: dict, pad: int) -> list[tuple[int, int]]:
    """Runs of placeholder tokens in the prompt parts (a random model may also sample the token)."""
    prompt = [t if m == 0 else -1 for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True)]
    ids, runs = prompt, []
    for index, token in enumerate(ids):
        if token == pad and (index == 0 or ids[index - 1] != pad):
            runs.append([index, 0])
        if token == pad:
            runs[-1][1] += 1
    return [tuple(run) for run in runs]


def test_openai_multi_turn_images_match_vllms_own_rendering(vl_tito, vl_vllm_server, tiny_vl_model_dir):
    tito, url = vl_tito
    pad = tito.renderer.images.image_token_id
    session = httpx.post(f"{url}/sessions").json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused")
    first = [
        {"role": "user", "content": [image_part(png_data_url(64, 80)), {"type": "text", "text": "what"}]}
    ]
    reply = client.chat.completions.create(model="tiny-vl", messages=first, max_tokens=6, temperature=0)

    # vLLM renders the same conversation with its own template and processor: same prompt, same reply.
    own = httpx.post(
        f"{vl_vllm_server.url}/v1/chat/completions",
        json={"model": str(tiny_vl_model_dir), "messages": first, "max_tokens": 6,
              "temperature": 0, "return_token_ids": True},
        timeout=120,
    ).json()  # fmt: skip
    trace = httpx.get(f"{url}/sessions/{session['id']}/trajectory").json()["segments"][0]
    num_prompt = reply.usage.prompt_tokens
    assert trace["token_ids"][:num_prompt] == own["prompt_token_ids"]
    assert trace["token_ids"][num_prompt:] == own["choices"][0]["token_ids"]

    second = [
        *first,
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": [{"type": "text", "text": "and"}, image_part(png_data_url(112, 112))]},
    ]
    chunks = client.chat.completions.create(
        model="tiny-vl", messages=second, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) is not None
    trajectory = httpx.delete(f"{url}/sessions/{session['id']}").json()
    (segment,) = trajectory["segments"]  # the second turn continued the first: one segment
    spans = [(image["offset"], image["length"]) for image in segment["images"]]
    assert spans == _image_runs(segment, pad) and [length for _, length in spans] == [6, 16]


def test_anthropic_multi_turn_images_stay_one_segment(vl_tito):
    tito, url = vl_tito
    pad = tito.renderer.images.image_token_id
    session = httpx.post(f"{url}/sessions").json()
    client = anthropic.Anthropic(base_url=session["session_url"], api_key="unused")

    def image_block(width: int, height: int) -> dict:
        data = png_data_url(width, height, (0, 160, 0)).split(",", 1)[1]
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}

    messages = [{"role": "user", "content": [image_block(56, 56), {"type": "text", "text": "what"}]}]
    for turn in range(2):
        reply = client.messages.create(model="tiny-vl", max_tokens=6, messages=messages)
        text = "".join(block.text for block in reply.content if block.type == "text")
        messages += [
            {"role": "assistant", "content": text or "-"},
            {"role": "user", "content": [{"type": "text", "text": "next"}, image_block(84, 56 + 28 * turn)]},
        ]
    trajectory = httpx.delete(f"{url}/sessions/{session['id']}").json()
    segments = trajectory["segments"]
    images = [image for segment in segments for image in segment["images"]]
    assert len(images) == 2  # the last user turn was never sent
    for segment in segments:
        assert [(i["offset"], i["length"]) for i in segment["images"]] == _image_runs(segment, pad)
