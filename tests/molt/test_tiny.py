"""The tiny-model fixture is proven against both of its consumers: transformers and a real vLLM server."""

from __future__ import annotations

import hashlib

import httpx
import pytest
import torch

from molt.tiny import build_tiny_model


def _tokenizer_and_model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def test_transformers_loads_an_untied_qwen3(tiny_model_dir):
    tokenizer, model = _tokenizer_and_model(tiny_model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.tie_word_embeddings is False
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_same_seed_gives_identical_weights(tmp_path):
    digests = set()
    for name in ("a", "b"):
        path = build_tiny_model(tmp_path / name, seed=3)
        digests.add(hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest())
    other = build_tiny_model(tmp_path / "c", seed=4)
    assert len(digests) == 1
    assert hashlib.sha256((other / "model.safetensors").read_bytes()).hexdigest() not in digests


def test_chat_template_is_chatml_with_hermes_tools_and_round_trips(tiny_model_dir):
    tokenizer, _ = _tokenizer_and_model(tiny_model_dir)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "copy the word: fox"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "2"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n<tools>\n")
    assert "<|im_start|>user\ncopy the word: fox<|im_end|>\n" in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    pieces = tokenizer.convert_ids_to_tokens(ids)
    for marker in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "fox", "assistant"):
        assert marker in pieces, f"{marker!r} is not a single token"


@pytest.mark.slow
def test_vllm_serves_the_fixture_and_agrees_with_transformers(tiny_model_dir, vllm_server):
    tokenizer, model = _tokenizer_and_model(tiny_model_dir)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "copy the word: owl"}], add_generation_prompt=True, tokenize=True
    )
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    body = {
        "token_ids": prompt_ids,
        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "logprobs": 0, "seed": 7},
    }
    reply = httpx.post(f"{vllm_server.url}/inference/v1/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    sampled = choice["token_ids"]
    engine_logp = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    assert len(sampled) == 4 and len(engine_logp) == 4

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + sampled])).logits[0, len(prompt_ids) - 1 : -1]
    hf_logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]
    torch.testing.assert_close(engine_logp, hf_logp, atol=1e-4, rtol=1e-4)
