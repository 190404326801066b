"""The token trace of one session, and the one place where tokens enter it.

Both agent forms go through `Capture`: the Env form hands it prompt token ids directly, the chat form
first turns messages into prompt token ids (`_chat.py`). A turn's prompt that extends the current
segment appends only its new tokens; a prompt that rewrites the prefix (context compaction, a template
that drops earlier reasoning) seals the segment and opens a new one. Sampled tokens are appended as the
engine returned them, with their logprob and weight version, and are the only tokens with loss mask 1.
Images are part of a segment: each sits on its placeholder tokens (`ImageSpan`), and a prompt extends
the segment only if its images on the shared tokens are the same images. Nothing here tokenizes or
detokenizes.

MoE routes (engines started with `--enable-return-routed-experts`): each reply carries the experts
every token of its request was routed to, from the first token whose route the capture does not hold
yet (`routes_known`, sent to the engine as `routed_experts_prompt_start`). A segment keeps the routes of
its first tokens as the engine first reported them, which is what its KV cache was computed with; the
last sampled token was never forwarded and has none.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    from ._engines import Generation

__all__ = ["Capture", "ImageSpan", "Segment", "Trajectory", "Turn"]


class ImageSpan(msgspec.Struct, frozen=True):
    """An image and the placeholder tokens it fills: `token_ids[offset : offset + length]`."""

    offset: int
    length: int
    sha256: str  # of the image bytes as the client sent them
    data_url: str  # those bytes, `data:<media type>;base64,...`


class Segment(msgspec.Struct, omit_defaults=True):
    """A contiguous token trace. loss_mask 1 = sampled by the engine; elsewhere logprob 0.0, version -1.
    `images`: the images among the tokens, in order (left out of the JSON when there are none).
    `routed_experts`: MoE routes, vLLM's encoding (base64 `.npy`, `(n, layers, top_k)`): the experts
    the engine sent each of the first n tokens to, n normally `len(token_ids) - 1`; empty (and left out
    of the JSON) when the engines return none. `routes()` decodes it."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    loss_mask: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    versions: list[int] = msgspec.field(default_factory=list)
    images: list[ImageSpan] = msgspec.field(default_factory=list)
    routed_experts: str = ""

    def routes(self) -> np.ndarray | None:
        """`routed_experts` as an array `(n, layers, top_k)`, or None without routes."""
        return _decode_routes(self.routed_experts) if self.routed_experts else None


def _decode_routes(encoded: str) -> np.ndarray:
    routes = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if routes.ndim != 3:
        raise ValueError(f"routed experts must be (tokens, layers, top_k), got shape {routes.shape}")
    return routes


def _encode_routes(routes: np.ndarray | None) -> str:
    if routes is None:
        return ""
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


class Turn(msgspec.Struct, omit_defaults=True):
    """One completed request of the session: where its sampled tokens sit, and how they were sampled.

    `sampling`: the parameters the engine sampled with; `asked`: those the client asked for that differ
    (a trainer's fixed sampling overrides them). `fields`: request fields that do not change the tokens
    (metadata, cache hints, ...), as received; `notes`: what tito did with fields it mapped or could not
    apply (thinking to the template's switch, say). `tool_parse_failures`: tool calls in the reply that
    did not parse (they stay in the reply's text)."""

    segment: int  # index into `Trajectory.segments`
    start: int  # where the turn's sampled tokens start in that segment
    num_sampled: int
    route: str = ""  # "chat.completions" | "messages" | "responses"; "" for the token-level Env form
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    asked: dict[str, Any] = msgspec.field(default_factory=dict)
    finish_reason: str | None = None
    fields: dict[str, Any] = msgspec.field(default_factory=dict)
    notes: list[str] = msgspec.field(default_factory=list)
    tool_parse_failures: int = 0


class Trajectory(msgspec.Struct):
    """A session's capture: its segments, and one `Turn` per completed request. `tool_parse_failures`
    counts, over all turns, tool calls the model wrote that did not parse."""

    session_id: str
    segments: list[Segment]
    turns: list[Turn] = msgspec.field(default_factory=list)
    tool_parse_failures: int = 0


class Capture:
    """The growing trajectory of one session."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.segments: list[Segment] = [Segment()]
        self._routes: list[np.ndarray | None] = [None]  # per segment: its first tokens' MoE routes
        self._turn_start = -1  # where the last turn's prompt ended in the current segment
        self._turn_prompt: tuple[list[int], list[ImageSpan]] | None = None
        self.replies: list[list[int]] = []  # each turn's sampled ids as appended; a retried turn's removed
        self.turns: list[Turn] = []  # one per entry of `replies`

    @property
    def tokens(self) -> list[int]:
        """The current segment's token ids (what the engine's prefix cache holds for this session)."""
        return self.segments[-1].token_ids

    @property
    def images(self) -> list[ImageSpan]:
        """The current segment's images."""
        return self.segments[-1].images

    @property
    def routes_known(self) -> int:
        """How many leading tokens of the current segment have their MoE routes captured."""
        routes = self._routes[-1]
        return 0 if routes is None else len(routes)

    def routes_known_after(self, prompt_ids: list[int], images: list[ImageSpan] = ()) -> int:
        """`routes_known` as it will be once `prompt_ids` is placed (`begin_turn`), without placing it."""
        if (prompt_ids, list(images)) == self._turn_prompt:
            return min(self.routes_known, self._turn_start)
        return self.routes_known if self._extends(self.segments[-1], prompt_ids, images) else 0

    def commit_turn(
        self,
        prompt_ids: list[int],
        images: list[ImageSpan],
        sampled: Generation,
        *,
        routes_from: int = 0,
        turn: Turn | None = None,
    ) -> None:
        """A completed turn, placed in one step: its prompt (`begin_turn`), then what the engine sampled.
        Nothing enters the capture before the turn completes, so a turn that fails leaves no trace."""
        self.begin_turn(prompt_ids, images)
        self.add_sampled(
            sampled.token_ids,
            sampled.logprobs,
            sampled.versions,
            routed_experts=sampled.routed_experts,
            routes_from=routes_from,
        )
        if turn is not None:
            self.turns[-1] = msgspec.structs.replace(
                turn,
                segment=self.turns[-1].segment,
                start=self.turns[-1].start,
                num_sampled=len(sampled.token_ids),
                finish_reason=sampled.finish_reason,
            )

    def begin_turn(self, prompt_ids: list[int], images: list[ImageSpan] = ()) -> None:
        """Make the current segment equal `prompt_ids` with `images` (all of the prompt's, in order),
        appending, rolling back or sealing as needed.

        - `prompt_ids` extends the segment: the new tokens are appended (loss mask 0).
        - `prompt_ids` equals the previous turn's prompt (an identical retry): that turn's sampled tokens
          are dropped, so a retry never duplicates tokens.
        - anything else rewrites the prefix: the segment is sealed and a new one starts with `prompt_ids`.
        """
        if not prompt_ids:
            raise ValueError("a turn needs at least one prompt token")
        segment = self.segments[-1]
        if (prompt_ids, list(images)) == self._turn_prompt:
            if len(segment.token_ids) > self._turn_start:  # the retried turn got a reply
                self.replies.pop()
                self.turns.pop()
            self._truncate(self._turn_start)
        elif not self._extends(segment, prompt_ids, images):
            self.segments.append(segment := Segment())
            self._routes.append(None)
        new = prompt_ids[len(segment.token_ids) :]
        segment.images = list(images)
        segment.token_ids += new
        segment.loss_mask += [0] * len(new)
        segment.logprobs += [0.0] * len(new)
        segment.versions += [-1] * len(new)
        self._turn_start = len(segment.token_ids)
        self._turn_prompt = (list(prompt_ids), list(images))

    @staticmethod
    def _extends(segment: Segment, prompt_ids: list[int], images: list[ImageSpan]) -> bool:
        """Whether the prompt starts with the segment: its tokens, and the same images on them."""
        length = len(segment.token_ids)
        shared = [image for image in images if image.offset < length]
        return prompt_ids[:length] == segment.token_ids and shared == segment.images

    def add_sampled(
        self,
        token_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        *,
        routed_experts: str | None = None,
        routes_from: int = 0,
    ) -> None:
        """Append tokens the engine sampled, exactly as it returned them. `routed_experts`: the routes
        the engine returned for this turn, starting at token `routes_from` of the segment (module
        docstring); only those of tokens without a route yet are kept."""
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError(
                f"sampled tokens, logprobs and versions differ in length: "
                f"{len(token_ids)}, {len(logprobs)}, {len(versions)}"
            )
        segment = self.segments[-1]
        self.replies.append(list(token_ids))
        self.turns.append(Turn(len(self.segments) - 1, len(segment.token_ids), len(token_ids)))
        segment.token_ids += token_ids
        segment.loss_mask += [1] * len(token_ids)
        segment.logprobs += logprobs
        segment.versions += versions
        if routed_experts:
            self._add_routes(_decode_routes(routed_experts), routes_from)

    def _add_routes(self, routes: np.ndarray, start: int) -> None:
        known, length = self.routes_known, len(self.segments[-1].token_ids)
        if start + len(routes) > length:
            raise ValueError(
                f"the engine returned routes for tokens {start}..{start + len(routes) - 1} of a segment "
                f"of {length} tokens"
            )
        if start > known:  # a gap: routes must cover the segment from its first token
            return
        old = self._routes[-1]
        if old is not None and old.shape[1:] != routes.shape[1:]:
            raise ValueError(f"routes of shape {routes.shape[1:]} follow routes of shape {old.shape[1:]}")
        new = routes[known - start :]
        self._routes[-1] = new if old is None else np.concatenate([old, new])

    def _truncate(self, length: int) -> None:
        segment = self.segments[-1]
        for field in (segment.token_ids, segment.loss_mask, segment.logprobs, segment.versions):
            del field[length:]
        segment.images = [image for image in segment.images if image.offset < length]
        if self._routes[-1] is not None:
            self._routes[-1] = self._routes[-1][:length]

    def trajectory(self) -> Trajectory:
        """A copy of the capture, without a trailing empty segment."""
        segments = [
            Segment(
                list(s.token_ids),
                list(s.loss_mask),
                list(s.logprobs),
                list(s.versions),
                list(s.images),
                _encode_routes(routes),
            )
            for s, routes in zip(self.segments, self._routes, strict=True)
            if s.token_ids
        ]
        offset = 0 if self.segments[0].token_ids else 1  # only the first segment can be empty
        turns = [msgspec.structs.replace(turn, segment=turn.segment - offset) for turn in self.turns]
        failures = sum(turn.tool_parse_failures for turn in turns)
        return Trajectory(self.session_id, segments, turns, failures)
