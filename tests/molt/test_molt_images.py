"""A vision-language policy's batches: images travel with their rows, the trainer's processor expands
them as the engine did, and the trainer's model (transformers' Qwen2-VL, fed `TrainBatch.model_inputs`)
gives the engine's own logprobs for the tokens it sampled after seeing the images."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from molt._batch import collate, with_images
from molt._dumps import read_rollouts, write_rollouts
from molt._rollout import Rollout
from tito import ChatState, ImageSpan, Segment, Tito


def png_data_url(width: int, height: int, colour=(200, 30, 30)) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), colour, np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(width: int, height: int, text: str) -> dict:
    part = {"type": "image_url", "image_url": {"url": png_data_url(width, height)}}
    return {"role": "user", "content": [part, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def processor(tiny_vl_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_model_dir)


def _span(offset: int, length: int, width: int = 56, height: int = 56) -> ImageSpan:
    return ImageSpan(offset, length, "0" * 64, png_data_url(width, height))


def test_images_travel_with_their_rows_through_shards_and_micro_batches(processor):
    pad = processor.image_token_id
    rows = [
        ([1, pad, pad, pad, pad, 2, 3], [0, 0, 0, 0, 0, 0, 1], [0.0] * 6 + [-0.5], 1.0),
        ([1, 2, 3], [0, 0, 1], [0.0, 0.0, -0.5], 1.0),
        ([1, pad, pad, pad, pad, 2, 3], [0, 0, 0, 0, 0, 0, 1], [0.0] * 6 + [-0.5], 1.0),
    ]
    batch = with_images(collate(rows, pad_id=0), [[_span(1, 4)], [], [_span(1, 4, 70, 56)]], processor)
    assert batch.images[1] is None and batch.images[0].spans == ((1, 4),)
    part = batch.select([2, 1])
    assert len(part.images) == 2 and part.images[0] is batch.images[2] and part.images[1] is None
    assert batch.select([]).images == (None,)  # a rank's empty turn: a row without images
    micro = [batch.select(rows) for rows in ([0, 1], [2])]
    assert [len(mb.images) for mb in micro] == [2, 1]
    inputs = micro[1].model_inputs(torch.device("cpu"))
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 1, 1, 0, 0]]
    assert micro[0].model_inputs(torch.device("cpu"))["pixel_values"].shape == (
        16,
        1176,
    )
    text_only = collate(rows[1:2], pad_id=0)
    assert text_only.images == () and text_only.select([]).images == ()
    assert text_only.model_inputs(torch.device("cpu")) == {}


def test_a_span_the_trainer_expands_differently_is_refused(processor):
    pad = processor.image_token_id
    row = ([1, pad, pad, pad, 2], [0, 0, 0, 0, 1], [0.0] * 4 + [-0.5], 1.0)
    with pytest.raises(
        RuntimeError, match=r"expands these images to \[4\] tokens, the engine expanded them to \[3\]"
    ):
        with_images(collate([row], pad_id=0), [[_span(1, 3)]], processor)


def test_dumps_carry_the_images(tmp_path):
    span = _span(1, 4)
    segment = Segment([1, 6, 6, 6, 6, 2, 3], [0] * 6 + [1], [0.0] * 6 + [-0.5], [-1] * 6 + [0], [span])
    group = type("Group", (), {"prompt_index": 0, "samples": [Rollout([segment], 1.0, [3], False)]})
    write_rollouts(tmp_path, 1, [group], positions=[0])
    (record,) = read_rollouts(tmp_path)
    assert (record.segments[0].images[0].offset, record.segments[0].images[0].data_url) == (1, span.data_url)


async def _two_image_turns(engine_url: str, model_dir) -> Segment:
    """Two turns with an image each through tito's Env path (tito checks the engine's expansion). A
    reply holding an image placeholder is sampled again, a retry that replaces it (molt refuses a
    rollout with one, `_rollout.py`)."""
    tito = Tito([engine_url], model_dir)
    session, state = tito.new_session(), ChatState()
    messages = [image_message(64, 80, "what")]
    for turn in range(2):
        prompt = state.prompt(tito.renderer, session.capture.tokens, messages, None, session.capture.images)
        out = await tito.generate(session, prompt.token_ids, images=prompt.images, max_tokens=5)
        while tito.renderer.images.image_token_id in out.token_ids:  # a random model may sample one
            out = await tito.generate(
                session, prompt.token_ids, images=prompt.images, max_tokens=5, retry=True
            )
        reply = {
            "role": "assistant",
            "content": tito.tokenizer.decode(out.token_ids, skip_special_tokens=True),
        }
        state.record(messages, None, prompt, reply, tito.renderer.closing_ids(out.token_ids))
        messages += [reply, image_message(112, 56 + 28 * turn, "and")]
    (segment,) = tito.end_session(session.id).segments
    await tito.aclose()
    return segment


@pytest.mark.slow
def test_trainer_expansion_and_logprobs_equal_the_engines(tiny_vl_model_dir, vl_vllm_server, processor):
    """The trainer rebuilds the pixels from an engine trajectory and recomputes the sampled tokens'
    logprobs with transformers' model: equal to the engine's when layout, pixels and positions agree."""
    from transformers import AutoModelForImageTextToText

    from molt._batch import shifted_logprobs

    segment = asyncio.run(_two_image_turns(vl_vllm_server.url, tiny_vl_model_dir))
    assert [image.length for image in segment.images] == [6, 8]

    batch = collate([(segment.token_ids, segment.loss_mask, segment.logprobs, 1.0)], pad_id=0)
    batch = with_images(batch, [segment.images], processor)  # raises if the expansions differ
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch.tokens_BT, use_cache=False, **batch.model_inputs(torch.device("cpu"))
        ).logits
    logp_BT = shifted_logprobs(logits, batch.tokens_BT, temperature=1.0)
    sampled = batch.loss_mask_BT > 0
    torch.testing.assert_close(logp_BT[sampled], batch.rollout_logp_BT[sampled], atol=2e-4, rtol=0)


@pytest.mark.slow
def test_a_refit_reaches_the_vl_engine(tiny_vl_model_dir, vl_vllm_server, processor):
    """New weights (the vision tower's and the language model's) refit into the engine: its logprobs
    after two images are the new model's. The engine gets its original weights back at the end."""
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText

    import refit
    from molt._batch import shifted_logprobs
    from molt.vllm_server import free_port

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir, dtype=torch.float32).eval()
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    engine = refit.Engine(vl_vllm_server.url, backend=refit.GLOO_BACKEND, trainer_host="127.0.0.1")
    try:
        refit.update_weights([engine], refit.full_params(model), version=1)
        segment = asyncio.run(_two_image_turns(vl_vllm_server.url, tiny_vl_model_dir))
        assert {v for v, m in zip(segment.versions, segment.loss_mask, strict=True) if m} == {1}
        batch = with_images(
            collate([(segment.token_ids, segment.loss_mask, segment.logprobs, 1.0)], pad_id=0),
            [segment.images],
            processor,
        )
        with torch.no_grad():
            inputs = batch.model_inputs(torch.device("cpu"))
            logits = model(input_ids=batch.tokens_BT, use_cache=False, **inputs).logits
        logp_BT = shifted_logprobs(logits, batch.tokens_BT, temperature=1.0)
        sampled = batch.loss_mask_BT > 0
        torch.testing.assert_close(logp_BT[sampled], batch.rollout_logp_BT[sampled], atol=2e-4, rtol=0)
    finally:
        model.load_state_dict(original)
        refit.update_weights([engine], refit.full_params(model), version=0)
        engine.close()
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("groups", "says"),
    [
        pytest.param({"fsdp": {"tp_size": 2}}, "runs data parallel only for now", id="tensor-parallel"),
        pytest.param({"algo": {"advantage": {"estimator": "gae"}}}, "the gae critic does not load", id="gae"),
    ],
)
def test_what_a_vision_language_policy_cannot_run_yet_is_refused(
    tiny_vl_model_dir, groups, says, monkeypatch
):
    import msgspec

    import molt._validate
    from molt.config import Config, ConfigError

    monkeypatch.setattr(molt._validate, "_on_gpu", lambda: True)  # tensor parallelism is CUDA's
    monkeypatch.setattr(molt._validate, "_local_gpus", lambda: 8)
    groups = {**groups, "model": {"path": str(tiny_vl_model_dir)}, "actor": {"num_ranks": 2}}
    config = msgspec.convert(msgspec.to_builtins(Config()) | groups, Config)
    with pytest.raises(ConfigError, match=says):
        molt._validate.validate(config)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, as meant
def test_export_writes_a_vl_checkpoint_with_its_processor(tiny_vl_model_dir, tmp_path):
    """A checkpoint of a VL policy exports as a directory transformers loads as that model, processor
    included (what a later run, or vLLM, serves)."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from molt._checkpoint import export

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir, dtype=torch.float32)
    checkpoint = tmp_path / "step_000001"
    (checkpoint / "model").mkdir(parents=True)
    for item in tiny_vl_model_dir.iterdir():  # as a checkpoint copies them: config and tokenizer files
        if item.suffix in {".json", ".jinja"}:
            shutil.copy2(item, checkpoint / "model" / item.name)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(checkpoint / "actor"), no_dist=True)
    out = export(checkpoint, tmp_path / "exported")
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    assert AutoProcessor.from_pretrained(out).image_token == "<|image_pad|>"
