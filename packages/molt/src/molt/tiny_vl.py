"""A tiny Qwen2-VL vision-language model and its processor, built offline and seeded.

The multimodal tests need a real vision-language model that transformers, vLLM and the actor all load,
small enough to run on a 2-core CPU. Qwen2-VL is the Qwen-VL generation that both transformers 5.18
and vLLM 0.26 implement without extras (no window attention, no deepstack features): a ViT whose
patches are merged 2 x 2 into one language-model token, and M-RoPE positions in the language model.

The tokenizer is the tiny text model's (`molt.tiny`: characters, ChatML and task words) plus Qwen-VL's
vision markers. The chat template renders an image content part (`{"type": "image"}` or OpenAI's
`{"type": "image_url", ...}`) as `<|vision_start|><|image_pad|><|vision_end|>`; the processor expands
each `<|image_pad|>` to one token per merged patch. Images are resized to between 56 x 56 and 112 x 112
pixels, so an image costs 4 to 16 tokens.
"""

from __future__ import annotations

from pathlib import Path

from molt.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, TASK_WORDS, _build_tokenizer

__all__ = ["IMAGE_TOKEN", "VL_CHAT_TEMPLATE", "VL_WORDS", "build_tiny_vl_model"]

IMAGE_TOKEN = "<|image_pad|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", IMAGE_TOKEN, "<|video_pad|>")
VL_WORDS = TASK_WORDS + ("red", "green", "blue", "circle", "square", "colour", "shape", "what")
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

_TEXT_PARTS = "{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}"
_TEXT_AND_IMAGE_PARTS = (
    "{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}"
    "{%- elif part.type in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
)
assert _TEXT_PARTS in CHAT_TEMPLATE
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TEXT_PARTS, _TEXT_AND_IMAGE_PARTS)


def build_tiny_vl_model(out_dir: str | Path, *, seed: int = 0, hidden_size: int = 64) -> Path:
    """Write a seeded tiny Qwen2-VL (fp32, untied embeddings) with its processor to `out_dir`.

    The same arguments give byte-identical weights. The directory loads with transformers'
    `AutoModelForImageTextToText` and `AutoProcessor`, and is what vLLM serves.
    """
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    out = Path(out_dir)
    tokenizer = _build_tokenizer(VL_WORDS, SPECIAL_TOKENS + VISION_TOKENS, VL_CHAT_TEMPLATE)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS + VISION_TOKENS}
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(size=size),
        video_processor=Qwen2VLVideoProcessor(size=size),
        tokenizer=tokenizer,
        chat_template=VL_CHAT_TEMPLATE,
    )
    head_dim = 32
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": hidden_size // head_dim,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        # M-RoPE: the rotary half of a head split over (time, height, width) positions.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "hidden_size": hidden_size}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=text["eos_token_id"], pad_token_id=text["pad_token_id"]
    )
    # transformers writes Qwen2-VL's legacy tensor names ("model.layers...", "visual..."), as the
    # published checkpoints have them; a refit sends the module's names and the engine maps both alike.
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
