"""`molt export`: a checkpoint's policy as a Hugging Face directory that a stock loader reads as the policy
that trained. The checkpoints here are written by DCP in this one process, as a rank writes its shards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _checkpoint(model_dir, model, tmp_path):
    """A checkpoint of `model` (its state as the actor saves it) with `model_dir`'s config and tokenizer."""
    import torch.distributed.checkpoint as dcp

    from molt._checkpoint import write_loop_state

    checkpoint = tmp_path / "step_000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(checkpoint / "actor"), no_dist=True)
    write_loop_state(checkpoint, 1, [], model_dir)
    return checkpoint


def test_export_keeps_the_models_generation_config(tiny_model_dir, tmp_path):
    """The model's own stop tokens and sampling defaults, which vLLM and transformers' generate read."""
    from transformers import AutoModelForCausalLM

    from molt._checkpoint import export

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation |= {"eos_token_id": [2, 0], "do_sample": True, "temperature": 0.6, "top_k": 20}
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = export(_checkpoint(model_dir, model, tmp_path), tmp_path / "out")
    exported = json.loads((out / "generation_config.json").read_text())
    assert {key: exported.get(key) for key in generation} == generation
