"""A vision-language policy on the actor's GPU path: NeMo AutoModel's image-text-to-text loader over NCCL.

Runs only with CUDA (the `gpu` marker). One rank, driven without Ray, and no tito or vLLM: the rows'
pixel inputs are built directly (random patches on a 2 x 2 merged grid), so it runs on a GPU machine
that has AutoModel but neither Ray nor vLLM.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from molt._batch import RowImages, StepInputs, collate
from molt.config import Actor, Config, Rollout
from molt.vllm_server import free_port

pytestmark = pytest.mark.gpu


def test_automodel_vl_worker_on_cuda_matches_transformers_and_trains(tiny_vl_model_dir):
    import dataclasses

    from transformers import AutoConfig, AutoModelForImageTextToText

    from molt._actor import PolicyWorker

    config = msgspec.structs.replace(
        Config(), actor=Actor(lr=1e-2, micro_batch_tokens=2048), rollout=Rollout(temperature=0.7)
    )
    worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_vl_model_dir), config)
    assert type(worker.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert next(worker.model.parameters()).is_cuda

    pad = AutoConfig.from_pretrained(tiny_vl_model_dir).image_token_id
    rows = [([1, pad, pad, 29, 31, 32], [0, 0, 0, 0, 1, 1], [0.0] * 4 + [-4.0, -4.0], 1.0),
            ([1, 26, 27, 33], [0, 0, 1, 1], [0.0, 0.0, -4.0, -4.0], -1.0),
            ([1, 28, pad, 34], [0, 0, 0, 1], [0.0] * 3 + [-4.0], 0.5)]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    grid_thw_I3 = torch.tensor([[1, 4, 2]])  # 8 patches, merged 2 x 2 into 2 tokens

    def images(offset: int, num_tokens: int) -> RowImages:
        grid = grid_thw_I3 if num_tokens == 2 else torch.tensor([[1, 2, 2]])
        pixels_PC = torch.randn(int(grid.prod()), 1176, generator=gen)
        return RowImages(pixels_PC, grid, ((offset, num_tokens),))

    batch = dataclasses.replace(collate(rows, pad_id=0), images=(images(1, 2), None, images(2, 1)))
    logp_BT = worker.logprobs(batch)

    reference = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir, dtype=torch.float32)
    with torch.no_grad():
        inputs = batch.model_inputs(torch.device("cpu"))
        logits = reference(input_ids=batch.tokens_BT, **inputs).logits[:, :-1] / 0.7
    expected_BT = torch.log_softmax(logits.float(), -1).gather(-1, batch.tokens_BT[:, 1:, None])[..., 0]
    mask_BT = batch.loss_mask_BT[:, 1:] > 0
    torch.testing.assert_close(logp_BT[:, 1:][mask_BT], expected_BT[mask_BT], atol=2e-4, rtol=2e-4)

    visual_before = next(worker.model.model.visual.parameters()).detach().clone()
    metrics = worker.train_step(batch, StepInputs(old_logp_BT=logp_BT))
    assert metrics["train/grad_norm"] > 0
    assert not torch.equal(next(worker.model.model.visual.parameters()).detach(), visual_before)
    torch.distributed.destroy_process_group()
