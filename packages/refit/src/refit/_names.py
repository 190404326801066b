"""Checkpoint names in the trainer's spelling, for refit's name check (used by the engine side,
`refit.vllm_worker`; kept free of vLLM imports)."""

from __future__ import annotations


def in_trainer_names(specs: list[list], trainer_names: list[str], mapper) -> list[list]:
    """The checkpoint's `[name, shape]` specs, each name the trainer spells differently replaced by the
    trainer's spelling, where vLLM's own name mapper (`hf_to_vllm_mapper`) takes both to the same parameter: a
    checkpoint written with a model's legacy names (Qwen2-VL's "model.layers...", "visual...") and a
    trainer sending transformers' module names ("model.language_model...", "model.visual...") load the
    same weights. Only names without a match are translated, and only to a single trainer name that
    ends alike (a mapper may stack q/k/v projections into one parameter)."""
    checkpoint_names = {name for name, _ in specs}
    unmatched: dict[str | None, list[str]] = {}
    for name in trainer_names:
        if name not in checkpoint_names:
            unmatched.setdefault(_mapped(mapper, name), []).append(name)
    translated = []
    for name, shape in specs:
        ending = name.split(".")[-2:]
        alike = [t for t in unmatched.get(_mapped(mapper, name), []) if t.split(".")[-2:] == ending]
        translated.append([alike[0] if len(alike) == 1 else name, shape])
    return translated


def _mapped(mapper, name: str) -> str | None:
    """The parameter `name` loads into (None: the engine drops it). `apply_list` is the mapper's public
    name-only call (vLLM's `WeightsMapper`); it leaves out the names it drops."""
    mapped = mapper.apply_list([name])
    return mapped[0] if mapped else None
