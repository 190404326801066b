"""Sessions and the one turn path that both agent forms share.

`Tito` owns the engines, the tokenizer and the sessions. A turn is: put the prompt into the session's
capture, sample on the session's engine, append what the engine sampled. The Env form calls
`Tito.generate(session, prompt_ids, ...)` directly with token ids; the HTTP routes first turn messages
into prompt ids, then sample on the same engine and commit the same way (`Capture.commit_turn`). Nothing
is captured until a turn completes, so a turn that fails, times out or is abandoned leaves the
trajectory as it was. Requests of one session run one at a time.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from ._chat import ChatRenderer, ChatState
from ._engines import Engine, Generation, Router
from ._images import ImageLayout
from ._tools import ToolCalls
from ._trajectory import Capture, ImageSpan, Trajectory, Turn
from ._workers import session_owner

NUM_ENDED_REMEMBERED = 10_000  # ended sessions whose reason a late request is told

# Sampling parameters that reshape the distribution beyond temperature and top_p: under a trainer's fixed
# sampling they are dropped (and recorded as asked), since the trainer's logprobs do not apply them.
_SHAPING = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class ContextFull(ValueError):
    """A turn's prompt leaves no room in the model's context: not one token can be sampled."""


@dataclass
class Session:
    id: str
    engine: Engine
    capture: Capture
    chat: ChatState = field(default_factory=ChatState)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The Responses API's recent responses (their conversations), which `previous_response_id` may name.
    responses: OrderedDict[str, list[dict]] = field(default_factory=OrderedDict)
    last_used: float = field(default_factory=time.monotonic)  # when a request last came or ended
    committed: bool = False  # whether its last chat request committed its turn (`ChatTurn`'s `retry`)

    @property
    def finish_reason(self) -> str | None:
        """That of the last completed turn ("length": cut at max_tokens)."""
        return self.capture.turns[-1].finish_reason if self.capture.turns else None


class TooManySessions(RuntimeError):
    """A new session would pass `Tito(max_sessions=...)`."""


class Tito:
    """Token-exact capture in front of vLLM engines.

    `engines`: engine base URLs. `model`: the model directory (its tokenizer and chat template are used
    here, and for a vision-language model its processor's image layout; engines must serve the same
    model). `dump`: a JSONL file that receives each ended session's
    trajectory. `fixed_sampling`: sampling parameters that apply to every turn whatever a client asks (a
    trainer fixes temperature and top_p so that its logprobs match the engine's); a `max_tokens` there
    caps each turn. `engine_transport`: an httpx transport for engine traffic (tests put a fake engine
    there). `idle_timeout`: seconds (more than 0) after its last request ended at which a session not in
    a request is ended (and dumped); None keeps sessions until they are ended. `max_sessions`: live
    sessions at most (at least 1; None: no cap); a new one past it raises `TooManySessions`. `worker`:
    (index, count) of this process among `tito serve --workers` processes; its sessions get the ids
    `_workers.session_owner` maps to it.
    `engine_model`: the model every engine request names, a LoRA adapter the engines serve (None: their
    base model). `stream_replies`: every reply is streamed from its engine, also those a client takes
    whole; `compact_stream`: the engines run refit's middleware, and streamed replies come from its
    compact route (both `_engines.Engine`). `processor`: `model`'s processor
    (`AutoProcessor.from_pretrained(model)`) where the caller has loaded it already (None: loaded here).
    """

    def __init__(
        self,
        engines: list[str],
        model: str | Path,
        *,
        served_model_name: str | None = None,
        dump: str | Path | None = None,
        request_timeout: float = 600.0,
        fixed_sampling: dict | None = None,
        engine_transport: httpx.AsyncBaseTransport | None = None,
        idle_timeout: float | None = None,
        max_sessions: int | None = None,
        worker: tuple[int, int] = (0, 1),
        engine_model: str | None = None,
        stream_replies: bool = False,
        compact_stream: bool = False,
        processor: Any = None,
    ) -> None:
        from transformers import AutoProcessor

        if idle_timeout is not None and not idle_timeout > 0:
            raise ValueError(
                f"idle_timeout must be more than 0 seconds (None keeps sessions until they are ended), "
                f"got {idle_timeout}"
            )
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1 (None: no cap), got {max_sessions}")
        self.model_name = served_model_name or str(model)
        # A text model's AutoProcessor is its tokenizer; a vision-language model's holds both.
        processor = processor if processor is not None else AutoProcessor.from_pretrained(model)
        vision = getattr(processor, "image_processor", None) is not None
        self.tokenizer = processor.tokenizer if vision else processor
        self.renderer = ChatRenderer(self.tokenizer, ImageLayout(processor) if vision else None)
        self.vocab_size = len(self.tokenizer)
        self.tool_calls = ToolCalls(self.tokenizer)  # the template's tool-call family and its parser
        self.router = Router(
            engines,
            timeout=request_timeout,
            transport=engine_transport,
            model=engine_model,
            stream_replies=stream_replies,
            compact_stream=compact_stream,
        )
        self.sessions: dict[str, Session] = {}
        self.dump_path = Path(dump) if dump else None
        self.fixed_sampling = dict(fixed_sampling or {})
        self.max_tokens_cap = self.fixed_sampling.pop("max_tokens", None)
        self.idle_timeout, self.max_sessions, self.worker = idle_timeout, max_sessions, worker
        # Why recent sessions ended, so that a late request hears it (bounded: memory stays flat).
        self.ended: OrderedDict[str, str] = OrderedDict()

    def new_session(self) -> Session:
        """A session bound to the least-loaded live engine. Ids are 128-bit random."""
        if self.max_sessions is not None and len(self.sessions) >= self.max_sessions:
            raise TooManySessions(
                f"{len(self.sessions)} sessions are live, the most this server keeps: end one "
                "(DELETE /sessions/{id}) or retry later"
            )
        session_id = secrets.token_hex(16)
        while self.worker[1] > 1 and session_owner(session_id, self.worker[1]) != self.worker[0]:
            session_id = secrets.token_hex(16)
        session = self.sessions[session_id] = Session(session_id, self.router.assign(), Capture(session_id))
        return session

    def end_session(self, session_id: str, *, reason: str = "was ended") -> Trajectory:
        """Forget a session, returning (and dumping, with `dump`) its trajectory. `reason` is what a
        later request naming it is told."""
        session = self.sessions.pop(session_id)
        self.ended[session_id] = reason
        while len(self.ended) > NUM_ENDED_REMEMBERED:
            self.ended.popitem(last=False)
        self.router.release(session.engine)
        trajectory = session.capture.trajectory()
        if self.dump_path is not None:
            with self.dump_path.open("ab", buffering=0) as dump:  # one write: workers share the file
                dump.write(msgspec.json.encode(trajectory) + b"\n")
        return trajectory

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End every session idle past `idle_timeout` and not in a request; returns their ids."""
        if self.idle_timeout is None:
            return []
        now = time.monotonic() if now is None else now
        idle = [
            session.id
            for session in self.sessions.values()
            if now - session.last_used > self.idle_timeout and not session.lock.locked()
        ]
        for session_id in idle:
            self.end_session(session_id, reason=f"expired after {self.idle_timeout:g} s without a request")
        return idle

    async def expire_idle_forever(self) -> None:
        """`expire_idle` every quarter of `idle_timeout` (at most every 30 s), until cancelled."""
        assert self.idle_timeout is not None  # started only with one
        while True:
            await asyncio.sleep(min(self.idle_timeout / 4, 30.0))
            self.expire_idle()

    async def sampling(self, session: Session, num_prompt_tokens: int, **params) -> dict:
        """vLLM sampling parameters for one turn; `max_tokens` defaults to the room left in the context."""
        room = await session.engine.max_model_len() - num_prompt_tokens
        if room < 1:
            raise ContextFull(
                f"the conversation is {num_prompt_tokens} tokens, which leaves no room in the model's "
                f"context of {room + num_prompt_tokens} tokens; shorten it"
            )
        asked = params.pop("max_tokens", None)
        # The trainer's distribution (under fixed sampling) is the plain softmax at its temperature.
        dropped = _SHAPING if self.fixed_sampling else ()
        params = {key: value for key, value in params.items() if value is not None and key not in dropped}
        max_tokens = min(limit for limit in (asked, self.max_tokens_cap, room) if limit)
        return {**params, **self.fixed_sampling, "max_tokens": max_tokens}

    async def generate(
        self,
        session: Session,
        prompt_ids: list[int],
        *,
        images: Sequence[ImageSpan] = (),
        retry: bool = False,
        **sampling,
    ) -> Generation:
        """The Env form: token ids in (with the images on their placeholder tokens, see `ChatRenderer`),
        sampled token ids (with logprobs and versions) out. A turn that fails is not captured. The last
        turn's prompt again is a second sample, kept beside the first; with `retry` it replaces the
        last turn's reply instead (`Capture.commit_turn`)."""
        if not prompt_ids:
            raise ValueError("a turn needs at least one prompt token")
        prompt_ids, images = list(prompt_ids), list(images)
        async with session.lock:
            if session.id not in self.sessions:  # ended while this turn waited for the one before it
                raise ValueError(f"session {session.id!r} {self.ended.get(session.id, 'has ended')}")
            params = await self.sampling(session, len(prompt_ids), **sampling)
            routes_from = session.capture.routes_known_after(prompt_ids, images, retry=retry)
            result = await session.engine.generate(prompt_ids, params, images=images, routes_from=routes_from)
            turn = Turn(0, 0, 0, sampling=params)
            session.capture.commit_turn(prompt_ids, images, result, turn=turn, retry=retry)
            return result

    async def aclose(self) -> None:
        await self.router.aclose()
