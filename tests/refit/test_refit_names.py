"""refit's name check reads a checkpoint's names in the trainer's spelling where vLLM loads both alike."""

from __future__ import annotations

from refit.vllm_worker import _in_trainer_names


def test_legacy_checkpoint_names_are_matched_through_vllms_mapper():
    from vllm.model_executor.models.utils import WeightsMapper

    # Qwen2-VL's mapper in vLLM: module names and legacy names reach the same parameter; q/k/v stack.
    mapper = WeightsMapper(
        orig_to_new_prefix={
            "model.language_model.": "language_model.model.",
            "model.visual.": "visual.",
            "lm_head.": "language_model.lm_head.",
            "model.": "language_model.model.",
        },
        orig_to_new_stacked={".q_proj": (".qkv", "q"), ".k_proj": (".qkv", "k")},
    )
    checkpoint = [["model.layers.0.self_attn.q_proj.weight", "float32", [4, 4]],
                  ["model.layers.0.self_attn.k_proj.weight", "float32", [2, 4]],
                  ["visual.blocks.0.norm1.weight", "float32", [4]],
                  ["lm_head.weight", "float32", [8, 4]],
                  ["model.unused.weight", "float32", [1]]]  # fmt: skip
    trainer = ["model.language_model.layers.0.self_attn.q_proj.weight",
               "model.language_model.layers.0.self_attn.k_proj.weight",
               "model.visual.blocks.0.norm1.weight", "lm_head.weight"]  # fmt: skip
    translated = _in_trainer_names(checkpoint, trainer, mapper)
    assert [name for name, _, _ in translated] == [*trainer, "model.unused.weight"]
    assert [spec[1:] for spec in translated] == [spec[1:] for spec in checkpoint]
