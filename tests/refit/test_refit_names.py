"""refit's name check reads a checkpoint's names in the trainer's spelling where vLLM loads both alike."""

from __future__ import annotations

from refit._names import in_trainer_names


class PrefixMapper:
    """What vLLM's Qwen2-VL `hf_to_vllm_mapper` does to these names (vLLM itself is not imported here):
    module names and legacy names reach the same parameter, and q/k/v projections stack into one."""

    PREFIXES = {"model.language_model.": "language_model.model.", "model.visual.": "visual.",
                "lm_head.": "language_model.lm_head.", "model.": "language_model.model."}  # fmt: skip

    def apply_list(self, names: list[str]) -> list[str]:
        return [self._map(name) for name in names]

    def _map(self, name: str) -> str:
        for old, new in self.PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        return name.replace(".q_proj", ".qkv").replace(".k_proj", ".qkv")


def test_legacy_checkpoint_names_are_matched_through_the_engines_mapper():
    mapper = PrefixMapper()
    checkpoint = [["model.layers.0.self_attn.q_proj.weight", [4, 4]],
                  ["model.layers.0.self_attn.k_proj.weight", [2, 4]],
                  ["visual.blocks.0.norm1.weight", [4]],
                  ["lm_head.weight", [8, 4]],
                  ["model.unused.weight", [1]]]  # fmt: skip
    trainer = ["model.language_model.layers.0.self_attn.q_proj.weight",
               "model.language_model.layers.0.self_attn.k_proj.weight",
               "model.visual.blocks.0.norm1.weight", "lm_head.weight"]  # fmt: skip
    translated = in_trainer_names(checkpoint, trainer, mapper)
    assert [name for name, _ in translated] == [*trainer, "model.unused.weight"]
    assert [spec[1:] for spec in translated] == [spec[1:] for spec in checkpoint]
