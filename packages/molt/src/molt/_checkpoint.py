"""Checkpoints (`--ckpt.every`), `molt train --resume RUN_DIR`, and `molt export`.

A checkpoint is a directory `<ckpt.dir>/step_000010/` holding:
- `actor/`: the policy's model and optimizer as a torch.distributed.checkpoint (every rank writes its own
  shards, and a run with another number of ranks can load it), and `actor/scheduler.pt`, the learning-rate
  schedule's state; under --actor.lora.rank the model holds the frozen base and the adapters (`lora_A`,
  `lora_B` beside each wrapped weight), the optimizer only the adapters', and `actor/adapter_config.json`
  their PEFT config, which `molt export` writes beside the adapters and needs to merge them;
- `critic/`: the same for the PPO critic, when the run has one (the frozen reference and teacher are not
  saved: a resumed run loads them again from the initial weights and `--algo.teacher.model`);
- `loop.json`: the loop's state (`LoopState`: the step, which rows were consumed, the driver's RNG);
- `model/`: the model's config and tokenizer, so that `molt export` needs nothing else.
`<ckpt.dir>/latest` names the newest complete checkpoint; it is written last, so a run stopped while
saving resumes from the one before.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import msgspec
import torch

LATEST = "latest"
LORA = "adapter_config.json"  # in <step>/actor of a LoRA policy: its PEFT config


class LoopState(msgspec.Struct):
    step: int  # the last optimizer step the checkpoint includes (= the engines' weight version)
    # positions in the row stream of every row trained, filtered or failed so far; its key in loop.json is
    # the one older checkpoints wrote, so that they resume
    consumed_rows: list[int] = msgspec.field(name="trained_rows")
    torch_rng: list[int]
    python_rng: list


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:06d}"


def save_actor(model, optimizer, scheduler, path: Path, *, rank: int, lora=None) -> None:
    """Every rank: write its shards of the model and optimizer into `path` (`<step>/actor` or
    `<step>/critic`); rank 0 also the scheduler and, for a LoRA policy (`lora`: its `molt.config.LoRA`),
    its PEFT config."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    if rank == 0:
        torch.save(scheduler.state_dict(), path / "scheduler.pt")
        if lora is not None:
            from molt._sharding import adapter_config

            (path / LORA).write_bytes(msgspec.json.encode(adapter_config(lora)))


def load_actor(model, optimizer, scheduler, path: Path) -> None:
    """Every rank: read its shards of the model and optimizer (resharded as needed) and the scheduler."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} holds no checkpoint of this group (was it saved by a run without it?)")
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))


def write_loop_state(path: Path, step: int, consumed_rows: list[int], model_dir: Path) -> None:
    """The driver's part of a checkpoint; then `latest` points at it (the checkpoint is complete)."""
    state = LoopState(
        step=step,
        consumed_rows=sorted(consumed_rows),
        torch_rng=torch.get_rng_state().tolist(),
        python_rng=json.loads(json.dumps(random.getstate())),
    )
    (path / "loop.json").write_bytes(msgspec.json.encode(state))
    (model_copy := path / "model").mkdir(exist_ok=True)
    for item in Path(model_dir).iterdir():  # config and tokenizer files, not the weights
        if item.is_file() and item.suffix in {".json", ".txt", ".model", ".jinja"}:
            shutil.copy2(item, model_copy / item.name)
    (path.parent / LATEST).write_text(path.name + "\n")


def latest(ckpt_dir: str | Path) -> tuple[Path, LoopState]:
    """The newest complete checkpoint under `ckpt_dir` and its loop state."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        raise ValueError(f"{ckpt_dir} holds no complete checkpoint: was the run started with --ckpt.every?")
    path = Path(ckpt_dir) / pointer.read_text().strip()
    return path, msgspec.json.decode((path / "loop.json").read_bytes(), type=LoopState)


def restore_rng(state: LoopState) -> None:
    torch.set_rng_state(torch.tensor(state.torch_rng, dtype=torch.uint8))
    version, internal, gauss = state.python_rng
    random.setstate((version, tuple(internal), gauss))


def export(checkpoint: str | Path, out_dir: str | Path, *, merged: bool = False) -> Path:
    """`molt export`: a checkpoint's policy weights as a Hugging Face directory (safetensors, config,
    tokenizer, and a vision-language model's processor) that transformers and vLLM load; a LoRA policy's
    as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer) for
    its base model, or with `merged` as the model with each adapter merged in. Runs in one process, with
    no process group."""
    import transformers

    checkpoint = Path(checkpoint)
    if (checkpoint / LATEST).is_file():  # a run's checkpoint directory: take its newest
        checkpoint, _ = latest(checkpoint)
    if not (checkpoint / "actor").is_dir() or not (checkpoint / "model" / "config.json").is_file():
        raise ValueError(f"{checkpoint} is not a molt checkpoint (no actor/ and model/config.json)")
    lora_file = checkpoint / "actor" / LORA
    lora = msgspec.json.decode(lora_file.read_bytes()) if lora_file.is_file() else None
    if merged and lora is None:
        raise ValueError(f"--merged merges LoRA adapters; {checkpoint}'s policy trained whole: drop --merged")
    config = transformers.AutoConfig.from_pretrained(checkpoint / "model")
    vision = hasattr(config, "vision_config")  # loaded as the actor loads it (`molt._sharding.load_model`)
    out_dir = Path(out_dir)
    if lora is not None and not merged:  # the adapters alone, under PEFT's names, beside their config
        from safetensors.torch import save_file

        state = _load(_adapters(checkpoint / "actor"), checkpoint / "actor")
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"base_model.model.{name}": tensor.contiguous() for name, tensor in state.items()}
        save_file(tensors, out_dir / "adapter_model.safetensors")
        (out_dir / "adapter_config.json").write_text(json.dumps(lora, indent=2) + "\n")
    else:
        loader = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
        model = loader.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
        weights = model.state_dict()
        adapters = _adapters(checkpoint / "actor", weights)
        state = _load({**weights, **adapters}, checkpoint / "actor")
        if lora is not None:  # merged: each wrapped weight W + alpha / rank * B @ A
            scale = lora["lora_alpha"] / lora["r"]
            for name in {key.rsplit(".lora_", 1)[0] for key in adapters}:
                a, b = (state.pop(f"{name}.lora_{part}.weight").float() for part in "AB")
                weight = state[f"{name}.weight"]
                state[f"{name}.weight"] = (weight.float() + scale * (b @ a)).to(weight.dtype)
        model.load_state_dict(state)
        if (checkpoint / "model" / "generation_config.json").is_file():  # its stop tokens, sampling defaults
            model.generation_config = transformers.GenerationConfig.from_pretrained(checkpoint / "model")
        model.save_pretrained(out_dir, safe_serialization=True)
    # the tokenizer, and a vision-language model's processor
    preprocessing = transformers.AutoProcessor if vision else transformers.AutoTokenizer
    preprocessing.from_pretrained(checkpoint / "model").save_pretrained(out_dir)
    return out_dir


def _load(tensors: dict[str, torch.Tensor], actor_dir: Path) -> dict[str, torch.Tensor]:
    """`tensors` (model names) filled from the checkpoint's model, in this one process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": tensors}, checkpoint_id=str(actor_dir), no_dist=True)  # in place
    return tensors


def _adapters(actor_dir: Path, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Empty tensors to load a LoRA policy's adapters into: each `lora_A` / `lora_B` weight the
    checkpoint holds (beside one of `weights`, where given; none for a policy trained whole)."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(actor_dir)).read_metadata().state_dict_metadata
    adapters = {}
    for key, meta in stored.items():
        name = key.removeprefix("model.")
        base = f"{name.rsplit('.lora_', 1)[0]}.weight"  # the weight it adapts
        if key.startswith("model.") and ".lora_" in name and (weights is None or base in weights):
            assert isinstance(meta, dcp.TensorStorageMetadata)  # a LoRA weight is a tensor
            adapters[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return adapters
