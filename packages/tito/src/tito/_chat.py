"""From chat messages to the prompt token ids of a turn, and from sampled text back to a message.

Messages arrive in one internal form (OpenAI-shaped dicts; the Anthropic route converts to it). The
chat template is rendered here, once per request, server side. For a request that continues the
session, only the new messages' text is tokenized, and it is appended to the session's own token
trace, which holds the assistant turns exactly as the engine sampled them: an assistant turn is never
re-tokenized. Whether a request continues the session is decided on messages, not on text, so an
assistant turn whose sampled text differs from the template's rendering of it (tool-call JSON spacing,
say) still counts as the same turn.

This module refuses to guess: if the template's rendering of the known conversation is not a text
prefix of the new rendering (a template that drops earlier reasoning, a compacted context), the request
starts a new segment from a full render.

Images (`image_url` parts of user messages, `_images.py`): the template writes one placeholder token
per image, and encoding expands each placeholder to the number of tokens the model's processor gives
that image, recording where each image sits (`ImageSpan`). A model without an image processor refuses
an image rather than render the text around it.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ._images import ImageLayout, image_parts, load_image, part_url
from ._trajectory import ImageSpan

_PROBE = "\x00tito-probe\x00"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def message_text(content: Any) -> str:
    """The text of a message's content: a string, a list of text parts, or None."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def is_text(content: Any) -> bool:
    """Whether `message_text` reads `content`: a string, None, or parts (objects) whose text is a string."""
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and (part.get("type") != "text" or isinstance(part.get("text"), str))
        for part in content
    )


def _message_key(message: dict) -> tuple:
    """What identifies a message for continuation: what the template renders, nothing else."""
    functions = [call["function"] for call in message.get("tool_calls") or ()]
    calls = tuple(
        (f["name"], json.dumps(parse_arguments(f.get("arguments")), sort_keys=True)) for f in functions
    )
    images = tuple(part_url(part) for part in image_parts(message.get("content")))
    return message["role"], message_text(message.get("content")), images, calls


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as an object where they parse (SDKs send a JSON string, we return an object)."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(arguments)
    return arguments


def tool_call(call_id: str | None, name: str | None, arguments: Any) -> dict:
    """A tool call of an assistant message in the internal form (`arguments` as `parse_arguments` gives)."""
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}


@dataclass
class Prompt:
    """A turn's prompt: token ids with each image's placeholders expanded, and the images on them."""

    token_ids: list[int]
    images: list[ImageSpan] = field(default_factory=list)


class ChatRenderer:
    """The model's chat template and tokenizer (and, for a vision-language model, its processor's image
    layout), applied the one way every request uses."""

    def __init__(self, tokenizer, images: ImageLayout | None = None) -> None:
        self.tokenizer = tokenizer
        self.images = images
        self.backend = tokenizer.backend_tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        # The template variable that turns the model's thinking on or off, if its template reads one.
        self.thinking_switch = "enable_thinking" if "enable_thinking" in template else None
        self.system_in_place = True  # while probing whether the template renders a late system message
        user = {"role": "user", "content": "x"}
        try:
            late = [user, {"role": "system", "content": _PROBE}, user]
            self.system_in_place = _PROBE in self.render(late, None, add_generation_prompt=True)
        except Exception:  # a template that raises on it (jinja's raise_exception) cannot render it
            self.system_in_place = False
        probe = [user, {"role": "assistant", "content": _PROBE}]
        rendered = self.render(probe, None, add_generation_prompt=False)
        # The text the template writes after an assistant message's content (ChatML: "<|im_end|>\n").
        self.turn_end = rendered[rendered.index(_PROBE) + len(_PROBE) :]
        self.turn_end_ids = self.encode(self.turn_end)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        *,
        add_generation_prompt: bool,
        switches: dict | None = None,
    ) -> str:
        """The template's text for `messages`. `switches`: template variables (`enable_thinking`). A
        system message after the first is rendered where it stands if the template can, else merged
        into the first system message (`system_in_place`)."""
        if not self.system_in_place:
            messages = merge_system_messages(messages)
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(switches or {}),
        )

    def encode(self, text: str) -> list[int]:
        # The tokenizers backend itself: the transformers call around it costs more than the encoding.
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_with_images(self, text: str, messages: list[dict], offset: int) -> Prompt:
        """`text` (the rendering of `messages`) as token ids whose image placeholders are expanded; the
        image spans count from `offset`, where these ids will start in the segment."""
        parts = [part for message in messages for part in image_parts(message.get("content"))]
        ids = self.encode(text)
        if not parts:
            return Prompt(ids)
        if self.images is None:
            raise ValueError("this model reads text only (its directory has no image processor): send text")
        for position, message in enumerate(messages):
            if image_parts(message.get("content")) and message["role"] != "user":
                raise ValueError(f"messages[{position}]: images may only be sent in user messages")
        token = self.images.image_token_id
        slots = [index for index, token_id in enumerate(ids) if token_id == token]
        if len(slots) != len(parts):
            raise ValueError(
                f"the chat template wrote {len(slots)} image placeholders for {len(parts)} images; "
                "its model's template must render every image part"
            )
        expanded: list[int] = []
        spans: list[ImageSpan] = []
        start = 0
        for slot, part in zip(slots, parts, strict=True):
            image = load_image(part_url(part))
            length = self.images.num_tokens(image)
            expanded += ids[start:slot]
            spans.append(ImageSpan(offset + len(expanded), length, image.sha256, image.data_url))
            expanded += [token] * length
            start = slot + 1
        return Prompt(expanded + ids[start:], spans)

    def closing_ids(self, sampled_ids: list[int]) -> list[int]:
        """Tokens that end an assistant turn after what the engine sampled: the template's turn end, less
        its first token when the engine sampled that token itself (ChatML: "\\n" after a sampled EOS).

        Compared by token, not by text: a reply cut at `max_tokens` on "<" has not begun "<|im_end|>"
        and gets the whole turn end, as the template renders it.
        """
        if sampled_ids and sampled_ids[-1:] == self.turn_end_ids[:1]:
            return self.turn_end_ids[1:]
        return list(self.turn_end_ids)


@dataclass
class ChatState:
    """What a session's chat turns have covered so far, to recognise a continuation, or the same request
    again (an SDK's retry or a resample; `Capture` tells them apart)."""

    messages: list[dict] = field(default_factory=list)  # last prompt messages + the reply we returned
    known_keys: list[tuple] = field(default_factory=list)  # the message keys of `messages`
    tools_key: str = ""
    closing: list[int] = field(default_factory=list)
    last_prompt: Prompt = field(default_factory=lambda: Prompt([]))
    # Earlier replies to the same request (a resample's siblings), latest first: a request may go on from
    # any of them. Each holds `trace`, the tokens its reply ends, set when its request was asked again.
    alternatives: list[ChatState] = field(default_factory=list)
    trace: list[int] = field(default_factory=list)

    def prompt(
        self,
        renderer: ChatRenderer,
        trace: list[int],
        messages: list[dict],
        tools: list[dict] | None,
        trace_images: Sequence[ImageSpan] = (),
        switches: dict | None = None,
    ) -> Prompt:
        """The full prompt of this turn: a trace (with its images) plus new tokens, or a fresh render
        on a rewrite. `trace`: the session's current segment, which the last reply ends; a request that
        goes on from an earlier reply to the same request (`alternatives`) continues that reply's trace.
        `switches`: template variables (`ChatRenderer.render`); a change is a rewrite."""
        keys = [_message_key(m) for m in messages]
        if _tools_key(tools, switches) == self.tools_key and self.known_keys:
            if keys == self.known_keys[:-1]:  # the same request again: a retry or a resample
                self.trace = list(trace)  # `record` sets this reply aside if the next one is kept
                return self.last_prompt
            branches = [(self, trace, trace_images)]
            branches += [(reply, reply.trace, reply.last_prompt.images) for reply in self.alternatives]
            for branch, branch_trace, images in branches:
                prompt = branch._continue(renderer, branch_trace, images, messages, keys, tools, switches)
                if prompt is not None:
                    return prompt
        text = renderer.render(messages, tools, add_generation_prompt=True, switches=switches)
        return renderer.encode_with_images(text, messages, offset=0)

    def _continue(
        self,
        renderer: ChatRenderer,
        trace: list[int],
        trace_images: Sequence[ImageSpan],
        messages: list[dict],
        keys: list[tuple],
        tools: list[dict] | None,
        switches: dict | None,
    ) -> Prompt | None:
        """The prompt of a request that goes on from this reply (its `trace`), or None if it does not."""
        num_known = len(self.known_keys)
        if len(keys) <= num_known or keys[:num_known] != self.known_keys:
            return None
        # Render the known turns as remembered, so only the new messages' rendering matters.
        old = renderer.render(self.messages, tools, add_generation_prompt=False, switches=switches)
        new_messages = messages[num_known:]
        new = renderer.render(
            self.messages + new_messages, tools, add_generation_prompt=True, switches=switches
        )
        if not new.startswith(old):
            return None
        head = trace + self.closing
        # A placeholder in the trace outside its images is one the model sampled itself: the engine,
        # expanding placeholders as it finds them, would put the next image there.
        images = renderer.images
        if images is not None and head.count(images.image_token_id) != sum(i.length for i in trace_images):
            raise ValueError(
                "an earlier reply of this conversation holds an image placeholder token the model sampled; "
                "the engine would read it as an image, so the conversation cannot continue: start a new one"
            )
        tail = renderer.encode_with_images(new[len(old) :], new_messages, offset=len(head))
        return Prompt(head + tail.token_ids, [*trace_images, *tail.images])

    def record(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        prompt: Prompt,
        reply: dict,
        closing: list[int],
        switches: dict | None = None,
    ) -> None:
        """Remember the turn just served: its prompt, and the assistant message the client received. A
        reply to the same request as the last one keeps the last one among `alternatives`."""
        keys = [_message_key(m) for m in messages]
        tools_key = _tools_key(tools, switches)
        again = bool(self.known_keys) and keys == self.known_keys[:-1] and tools_key == self.tools_key
        assert self.trace or not again, "`prompt` keeps the trace of a reply whose request is asked again"
        self.alternatives = [replace(self, alternatives=[]), *self.alternatives] if again else []
        self.messages = [*messages, reply]
        self.known_keys = [*keys, _message_key(reply)]
        self.tools_key = tools_key
        self.closing = closing
        self.last_prompt = prompt
        self.trace = []


def merge_system_messages(messages: list[dict]) -> list[dict]:
    """Every system message's text joined, in order, into one system message first."""
    systems = [message_text(m.get("content")) for m in messages if m["role"] == "system"]
    if len(systems) < 2 and (not systems or messages[0]["role"] == "system"):
        return messages
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


def _tools_key(tools: list[dict] | None, switches: dict | None = None) -> str:
    """What else the rendering depends on: the tools and the template switches."""
    return json.dumps([tools, switches or {}], sort_keys=True) if tools or switches else ""


@dataclass
class ParsedReply:
    """Sampled text split into plain content and tool calls ({"id", "name", "arguments": dict})."""

    content: str
    tool_calls: list[dict]
    failures: int = 0  # tool calls the model began that did not parse (left in `content`)

    def message(self) -> dict:
        """The assistant message in the internal form (tool-call arguments as objects)."""
        calls = [tool_call(c["id"], c["name"], c["arguments"]) for c in self.tool_calls]
        return {"role": "assistant", "content": self.content, **({"tool_calls": calls} if calls else {})}


def new_call(id_prefix: str, name: str, arguments: Any) -> dict:
    """A tool call parsed out of a reply, as `ParsedReply` holds it, under a new id."""
    return {"id": id_prefix + secrets.token_hex(12), "name": name, "arguments": arguments}


def parse_reply(text: str, *, id_prefix: str = "call_") -> ParsedReply:
    """Split Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks out of `text`.

    A block whose JSON does not parse, or lacks a string name or object arguments, stays in the content
    as text: a malformed tool call is the model's output, not a server error. Each such block, and a
    block opened but never closed, counts in `failures` (recorded with the turn in the trajectory).
    """
    calls: list[dict] = []
    kept: list[str] = []
    position = failures = last_end = 0
    for match in _TOOL_CALL.finditer(text):
        last_end = match.end()
        call = parse_arguments(match.group(1))  # the block's JSON, or its text where that does not parse
        arguments = parse_arguments(call.get("arguments", {})) if isinstance(call, dict) else None
        if not isinstance(arguments, dict) or not isinstance(call.get("name"), str):
            failures += 1
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(new_call(id_prefix, call["name"], arguments))
    kept.append(text[position:])
    failures += text[last_end:].count("<tool_call>")  # opened and never closed (cut off, say)
    return ParsedReply("".join(kept), calls, failures)
