"""The token trace of one session, and the one place where tokens enter it.

Both agent forms go through `Capture`: the Env form hands it prompt token ids directly, the chat form
first turns messages into prompt token ids (`_chat.py`). A turn's prompt that extends the current
segment appends only its new tokens; a prompt that rewrites the prefix (context compaction, a template
that drops earlier reasoning) opens a new segment. Sampled tokens are appended as the engine returned
them, with their logprob and weight version, and are the only tokens with loss mask 1.

The last turn's prompt again is one of two things, which only the caller can tell apart. A retry
(`retry=True`: an SDK retrying a request whose reply it never received) replaces that turn's reply. Any
other is a second sample (best-of-n, self-consistency, a verifier picking one): it is kept, in a new
segment that holds the prompt again and the new reply, so each sample sits whole after the prompt it
answers. A prompt continues the segment it extends, the current one if it extends that, else the
latest other: an agent that goes on from its first sample grows that sample's segment, and the reply it
kept is trained as what it continued from.

Images are part of a segment: each sits on its placeholder tokens (`ImageSpan`), and a prompt extends
the segment only if its images on the shared tokens are the same images. Nothing here tokenizes or
detokenizes.

MoE routes (engines started with `--enable-return-routed-experts`): each reply carries the experts
every token of its request was routed to, from the first token whose route the capture does not hold
yet (`routes_known_after`, sent to the engine as `routed_experts_prompt_start`). A segment keeps the
routes of its first tokens as the engine first reported them, which is what its KV cache was computed
with; the last sampled token was never forwarded and has none.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    from ._engines import Generation


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


def _checked_routes(encoded: str | None, old: np.ndarray | None, length: int) -> np.ndarray | None:
    """The routes a segment holds once a reply's MoE routes (`encoded`, None without) follow those it
    holds (`old`, for its first tokens): in their shape, within the segment (of `length` tokens with the
    reply). None when neither has any."""
    if not encoded:
        return old
    routes = _decode_routes(encoded)
    start = 0 if old is None else len(old)
    if start + len(routes) > length:
        raise ValueError(
            f"the engine returned routes for tokens {start}..{start + len(routes) - 1} of a segment "
            f"of {length} tokens"
        )
    if old is None:
        return routes
    if old.shape[1:] != routes.shape[1:]:
        raise ValueError(f"routes of shape {routes.shape[1:]} follow routes of shape {old.shape[1:]}")
    return np.concatenate([old, routes])


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
        self._current = 0  # the segment the last turn went to
        self._turn_prompt: tuple[list[int], list[ImageSpan]] | None = None
        self.turns: list[Turn] = []  # one per completed turn; a retried turn's replaced by the retry's

    @property
    def tokens(self) -> list[int]:
        """The current segment's token ids (what the engine's prefix cache holds for this session)."""
        return self.segments[self._current].token_ids

    @property
    def images(self) -> list[ImageSpan]:
        """The current segment's images."""
        return self.segments[self._current].images

    @property
    def replies(self) -> list[list[int]]:
        """Each turn's sampled ids, as the engine returned them."""
        return [self.segments[t.segment].token_ids[t.start : t.start + t.num_sampled] for t in self.turns]

    def routes_known_after(
        self, prompt_ids: list[int], images: Sequence[ImageSpan] = (), *, retry: bool = False
    ) -> int:
        """How many leading tokens of the segment `prompt_ids` continues have their MoE routes captured
        (`commit_turn` places it there), without placing it."""
        routes = self._routes_after(*self._place(prompt_ids, images, retry))
        return 0 if routes is None else len(routes)

    def commit_turn(
        self,
        prompt_ids: list[int],
        images: Sequence[ImageSpan],
        sampled: Generation,
        *,
        turn: Turn | None = None,
        retry: bool = False,
    ) -> None:
        """A completed turn (`turn`: how it was asked for), placed in one step: its prompt, then what the
        engine sampled, exactly as it returned them. Nothing enters the capture before the turn
        completes, and the engine's reply is checked before anything is placed, so a turn that fails, at
        the engine or in that check, leaves no trace.

        The prompt makes the segment it continues equal `prompt_ids` with `images` (all of the prompt's,
        in order), appending, rolling back or opening a segment as needed:
        - `retry` and `prompt_ids` equals the last turn's prompt: that turn's sampled tokens (and its
          `Turn`) are dropped, so a retry never duplicates tokens.
        - `prompt_ids` extends the current segment, or else another: the new tokens are appended to it
          (loss mask 0), and it becomes the current one.
        - anything else (a prefix rewrite, the last prompt again without `retry`): a new segment starts
          with `prompt_ids`.
        """
        token_ids, logprobs, versions = sampled.token_ids, sampled.logprobs, sampled.versions
        if not prompt_ids:
            raise ValueError("a turn needs at least one prompt token")
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError(
                f"sampled tokens, logprobs and versions differ in length: "
                f"{len(token_ids)}, {len(logprobs)}, {len(versions)}"
            )
        # a retry of the last turn: its prompt again, with `retry`
        retried = retry and (prompt_ids, list(images)) == self._turn_prompt
        index, keep = self._place(prompt_ids, images, retried)
        length = len(prompt_ids) + len(token_ids)
        routes = _checked_routes(sampled.routed_experts, self._routes_after(index, keep), length)
        if index == len(self.segments):
            self.segments.append(Segment())
            self._routes.append(None)
        segment, new = self.segments[index], prompt_ids[keep:]
        if retried:  # the reply it replaces goes, even one of no tokens
            self.turns.pop()
            for field in (segment.token_ids, segment.loss_mask, segment.logprobs, segment.versions):
                del field[keep:]
        segment.images = list(images)
        segment.token_ids += new + token_ids
        segment.loss_mask += [0] * len(new) + [1] * len(token_ids)
        segment.logprobs += [0.0] * len(new) + logprobs
        segment.versions += [-1] * len(new) + versions
        self._routes[index], self._current = routes, index
        self._turn_prompt = (list(prompt_ids), list(images))
        self.turns.append(
            msgspec.structs.replace(
                turn or Turn(0, 0, 0),
                segment=index,
                start=len(prompt_ids),
                num_sampled=len(token_ids),
                finish_reason=sampled.finish_reason,
            )
        )

    def _place(self, prompt_ids: list[int], images: Sequence[ImageSpan], retried: bool) -> tuple[int, int]:
        """Where a turn with this prompt goes: (segment index, how many of its tokens stay), the index
        past the last segment for a new one; `retried`: a retry of the last turn, which replaces its reply.
        Checks the current segment first: the common case."""
        if retried:
            return self._current, len(prompt_ids)
        order = [self._current, *(i for i in reversed(range(len(self.segments))) if i != self._current)]
        for index in order:
            if self._extends(self.segments[index], prompt_ids, images):
                return index, len(self.segments[index].token_ids)
        return len(self.segments), 0

    @staticmethod
    def _extends(segment: Segment, prompt_ids: list[int], images: Sequence[ImageSpan]) -> bool:
        """Whether the prompt starts with the segment: its tokens, and the same images on them."""
        length = len(segment.token_ids)
        if length and prompt_ids[length - 1 : length] != segment.token_ids[-1:]:
            return False  # a cheap look at one token first: most segments a prompt does not extend
        shared = [image for image in images if image.offset < length]
        return prompt_ids[:length] == segment.token_ids and shared == segment.images

    def _routes_after(self, index: int, keep: int) -> np.ndarray | None:
        """The routes segment `index` holds once cut to `keep` tokens (None for a new segment)."""
        routes = self._routes[index] if index < len(self._routes) else None
        return None if routes is None else routes[:keep]

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
        return Trajectory(self.session_id, segments, turns, sum(turn.tool_parse_failures for turn in turns))
