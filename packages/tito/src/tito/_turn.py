"""One chat turn, from messages to sampled text, shared by the chat, Responses and messages routes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from fastapi import Request

from ._chat import ParsedReply, Prompt
from ._engines import Generation
from ._fields import check_constraints
from ._protocol import Asked, ChatBody, ProtocolError, TextStream
from ._service import Session, Tito
from ._trajectory import Turn


class ChatTurn:
    """Render the prompt (only new tokens for a continuation), sample, parse, remember the reply.

    `body`: the route's request, which names the route and whether its reply is parsed for tool calls;
    `asked`: what it asks of the turn. `start()` opens the engine stream and waits for its first chunk,
    so an engine that does not answer surfaces before a streamed response has sent anything. A request
    that is an SDK's retry of an earlier attempt (the stock openai and anthropic SDKs number each attempt
    in `x-stainless-retry-count`, 0 on the first: their `_base_client.py`) replaces the session's last
    turn only if that turn was the attempt it retries: the last request of the session, committed (its
    reply was lost on the way back). The retry of an attempt that failed replaces nothing, since that
    attempt left no trace.
    """

    def __init__(
        self,
        tito: Tito,
        session: Session,
        request: Request,
        body: ChatBody,
        messages: list[dict],
        tools: list[dict] | None,
        asked: Asked,
    ) -> None:
        self.tito, self.session, self.request, self.body, self.asked = tito, session, request, body, asked
        self.messages, self.tools = messages, tools
        retries = request.headers.get("x-stainless-retry-count", "0")
        self.retry = retries.isdigit() and int(retries) > 0
        self.parse_tools = parse_tools = body.parse_tools()
        hold_all = parse_tools and tito.tool_calls.family != "hermes"
        stops = asked.sampling.get("stop")
        self.text = TextStream(tito.tokenizer, stops=stops, hold_tool_calls=parse_tools, hold_all=hold_all)
        self.generation = Generation()
        self.parsed = ParsedReply("", [])
        self.prompt = Prompt([])
        self._chunks: AsyncIterator[Generation] | None = None
        self._first: Generation | None = None
        self.committed = False
        self.switches = self._switches(asked)
        self.record = Turn(0, 0, 0)

    async def start(self, *, stream: bool) -> None:
        asked = self.asked
        if self.session.id not in self.tito.sessions:  # ended while this request waited for the lock
            raise ProtocolError(404, f"session {self.session.id!r} has ended", "not_found")
        self.retry, self.session.committed = self.retry and self.session.committed, False
        check_constraints(bool(self.tito.fixed_sampling), asked.constraints)
        family = self.tito.tool_calls.family
        forced = [c for c in asked.constraints if c.startswith("tool_choice")]
        if forced and family != "hermes":
            raise ProtocolError(
                400,
                f"{forced[0]}: forced tool calls are constrained in the Hermes form only, and this "
                f"model's template writes {family} tool calls; use tool_choice auto",
                param="tool_choice",
            )
        try:
            capture = self.session.capture
            prompt = self.prompt = self.session.chat.prompt(
                self.tito.renderer, capture.tokens, self.messages, self.tools, capture.images, self.switches
            )
            params = await self.tito.sampling(self.session, len(prompt.token_ids), **asked.sampling)
        except ValueError as error:
            raise ProtocolError(400, str(error)) from error
        differs = {k: v for k, v in asked.sampling.items() if v is not None and params.get(k) != v}
        self.record = Turn(0, 0, 0, self.body.route, params, differs, fields=asked.fields, notes=asked.notes)
        routes_from = capture.routes_known_after(prompt.token_ids, prompt.images, retry=self.retry)
        sampled = await self.session.engine.generate(
            prompt.token_ids, params, images=prompt.images, stream=stream, routes_from=routes_from
        )
        self._chunks = sampled if stream else None
        self._first = await anext(sampled, None) if stream else sampled

    def _switches(self, asked: Asked) -> dict:
        """The chat template's switches for this request; what was mapped how goes to `asked.notes`."""
        renderer, notes, switches = self.tito.renderer, asked.notes, {}
        if asked.thinking is not None:
            if renderer.thinking_switch:
                switches[renderer.thinking_switch] = asked.thinking
                notes.append(f"{asked.thinking_field}: {renderer.thinking_switch}={asked.thinking}")
            else:
                notes.append(f"{asked.thinking_field}: the chat template has no thinking switch; not applied")
        if not renderer.system_in_place and any(m["role"] == "system" for m in self.messages[1:]):
            notes.append("a system message among the turns was merged into the first system message")
        return switches

    async def deltas(self) -> AsyncIterator[str]:
        """Text that may be shown as it arrives; `parsed` holds the whole reply once this ends."""
        chunk = self._first
        while chunk is not None:
            self.generation.extend(chunk)
            if delta := self.text.push(chunk.token_ids):
                yield delta
            chunk = None if self._chunks is None else await anext(self._chunks, None)
        text = self.text.finish()
        self.generation.stop_reason = self.text.stop
        if self.parse_tools:
            self.parsed = self.tito.tool_calls.parse(
                text, self.generation.token_ids, self.tools, self.body.id_prefix
            )
        else:
            self.parsed = ParsedReply(text, [])
        # Content held back while it could have been a stop string or a tool call.
        if rest := self.parsed.content[self.text.sent :]:
            yield rest

    def commit(self, reply_message: dict) -> None:
        """The turn completed and the client has its reply: capture it, and record the assistant message
        the client received so that its next request can continue. One step, no await inside (the
        session's lock is held): a turn that does not get here (engine error, timeout, client gone,
        cancelled) leaves no trace."""
        record = msgspec.structs.replace(self.record, tool_parse_failures=self.parsed.failures)
        prompt = self.prompt
        self.session.capture.commit_turn(
            prompt.token_ids, prompt.images, self.generation, turn=record, retry=self.retry
        )
        self.committed = self.session.committed = True
        closing = self.tito.renderer.closing_ids(self.generation.token_ids)
        self.session.chat.record(self.messages, self.tools, prompt, reply_message, closing, self.switches)

    @property
    def counts(self) -> tuple[int, int]:
        return len(self.prompt.token_ids), len(self.generation.token_ids)

    @property
    def finish(self) -> str:
        """How the reply ended, in the chat-completions words: "length" (cut at max_tokens), "tool_calls",
        or "stop" (an aborted reply ends too)."""
        if self.generation.finish_reason == "length":
            return "length"
        return "tool_calls" if self.parsed.tool_calls else "stop"
