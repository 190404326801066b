"""A tiny Qwen3-architecture causal LM and its tokenizer, built offline and seeded.

Tests and the default recipe need a real model that transformers, vLLM and AutoModel all load, that
decodes fast on a 2-core CPU, and that can learn a toy task within minutes. Nothing is downloaded: the
tokenizer is assembled from characters and a handful of whole-word tokens, the weights are drawn from
a seeded generator, and the result is an ordinary Hugging Face directory.

The vocabulary is printable ASCII plus newline, the ChatML and tool-call markers, and whole-word tokens
for the words of the toy task (so the right first answer token is about 1 in 120 at start, which a
group of samples can find). Characters outside printable ASCII map to `<|unk|>`: this tokenizer is
for tests and toy recipes, not for real text.

The chat template is ChatML with tools in the Hermes form: tool schemas are listed in the system turn,
an assistant calls a tool with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and tool
results come back in a `tool` turn. Untied input and output embeddings.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

__all__ = ["TASK_WORDS", "CHAT_TEMPLATE", "build_tiny_model"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
ROLE_WORDS = ("system", "user", "assistant", "tool")
TASK_WORDS = ("copy", "the", "word", "next", "fox", "cat", "dog", "owl", "bee")

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content -%}{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(first=0, system='') -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set ns.first = 1 -%}{%- set ns.system = text(messages[0].content) -%}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
{% if ns.system %}{{ ns.system }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>
{% elif ns.system -%}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif -%}
{%- for message in messages[ns.first:] -%}
<|im_start|>{{ message.role }}
{{ text(message.content) }}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set args = call.function.arguments -%}
<tool_call>{"name": "{{ call.function.name }}", "arguments": \
{{ args if args is string else args | tojson }}}</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""


def _build_tokenizer(
    words: tuple[str, ...], specials: tuple[str, ...] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE
):
    """Specials first (stable ids), then single characters, then whole words as added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII + "\n"
    vocab = {token: i for i, token in enumerate(specials + tuple(chars))}
    added = list(TOOL_TOKENS) + [w for w in dict.fromkeys(ROLE_WORDS + words) if len(w) > 1]
    # A BPE with no merges splits text into characters; Fuse joins decoded pieces without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|unk|>",
        model_max_length=4096,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


# The tiny model's attention shape, which the config checks read before the model is built.
TINY_SHAPE: dict[str, Any] = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    words: tuple[str, ...] = TASK_WORDS,
    hidden_size: int = 64,
    num_layers: int = 2,
) -> Path:
    """Write a seeded tiny Qwen3 causal LM (fp32, untied embeddings) and its tokenizer to `out_dir`.

    The same arguments give byte-identical weights. Returns the directory, loadable with
    `transformers.AutoModelForCausalLM.from_pretrained` and servable by vLLM.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    tokenizer = _build_tokenizer(tuple(words))
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id  # <|im_end|>, <|endoftext|>
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        **TINY_SHAPE,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
