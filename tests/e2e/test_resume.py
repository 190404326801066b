"""Checkpoints, `molt train --resume` and `molt export`, end to end on the tiny model.

Sampling is made reproducible with `--rollout.seed_requests` (every request carries a seed from its row,
sample and turn) and strict on-policy steps, so an uninterrupted run (the session's `plain_run`) and a run
stopped after step 2 and resumed must train the same rows into the same steps 3 and 4.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from molt_runs import molt, reproducible_run_args, steps_of

pytestmark = pytest.mark.slow


def test_a_resumed_run_continues_exactly_and_its_checkpoint_exports(
    tmp_path, tiny_model_dir, molt_engine, ray_cluster, plain_run
):
    whole, stopped = plain_run.dir, tmp_path / "stopped"  # whole: 4 steps in one run
    common, env = reproducible_run_args(tiny_model_dir, molt_engine.url, ray_cluster.address), ray_cluster.env
    molt("train", *common, "--train.num_steps", "2", "--logger.run_dir", str(stopped), env=env)
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step_000002"
    resumed = molt("train", "--resume", str(stopped), "--train.num_steps", "4", env=env)
    assert "resumed from" in resumed.stderr

    expected, got = steps_of(whole), steps_of(stopped)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step]["rollout/reward_mean"] == expected[step]["rollout/reward_mean"]
        assert got[step]["rollout/response_len_mean"] == expected[step]["rollout/response_len_mean"]
        for key in ("train/policy_loss", "train/grad_norm", "train/entropy", "train/lr"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-6), (step, key)
        assert got[step]["train/staleness_mean"] == 0.0  # the engines served the checkpoint's weights

    out = tmp_path / "export"
    molt("export", str(stopped / "checkpoints"), str(out), env=env)  # the newest: step 4
    from transformers import AutoModelForCausalLM

    from molt.vllm_server import VLLMServer

    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = [5, 6, 7, 8, 9]
    with VLLMServer(out, log_path=tmp_path / "export-vllm.log") as server:
        sampling = {"max_tokens": 1, "temperature": 1.0, "logprobs": 0}
        body = {"model": str(out), "token_ids": prompt, "sampling_params": sampling}
        reply = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()
    choice = reply["choices"][0]
    token, engine_logp = choice["token_ids"][0], choice["logprobs"]["content"][0]["logprob"]
    with torch.no_grad():
        logp_V = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert engine_logp == pytest.approx(logp_V[token].item(), abs=1e-4)  # vLLM serves the exported weights
