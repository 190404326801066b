"""Rollout dumps (`--train.rollout_dump_dir`): every trained rollout as one JSON line, and their reader.

One file per optimizer step, `step_000001.jsonl`, ..., each line a `RolloutRecord`: the step that trained
it, its group (the dataset row's index in the prompt stream) and its sample index in the group, the
reward, what the agent logged in `info`, whether the last turn hit the token limit, and the token-exact
trajectory (tito's segments: token ids, loss mask, engine logprobs, weight versions per token, and for
a vision-language policy the images on their placeholder tokens, as data URLs; with
`--train.routing_replay`, the engine's MoE routes). The decoded text is
not stored; decode `token_ids` with the run's tokenizer (`<run_dir>/model`).

    for record in molt.read_rollouts("runs/my-run/rollouts"):
        print(record.step, record.reward, sum(sum(s.loss_mask) for s in record.segments))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec


class ImageSpan(msgspec.Struct, frozen=True):
    """tito's `ImageSpan`: an image on `token_ids[offset : offset + length]`."""

    offset: int
    length: int
    sha256: str  # of the image bytes
    data_url: str  # the bytes, data:<media type>;base64,...


class Segment(msgspec.Struct, omit_defaults=True):
    """tito's `Segment` as read back (tito itself is not imported: `import molt` stays light)."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 = sampled by the engine
    logprobs: list[float]  # the engine's, 0.0 where loss_mask is 0
    versions: list[int]  # the weight version that sampled each token, -1 where loss_mask is 0
    images: list[ImageSpan] = []  # left out of a line without images
    routed_experts: str = ""  # MoE routes, base64 `.npy` (tito's `Segment`); left out without routes


class RolloutRecord(msgspec.Struct):
    step: int
    group: int
    sample: int
    reward: float
    truncated: bool
    info: dict[str, float]
    segments: list[Segment]


def write_rollouts(dump_dir: Path, step: int, groups: list, positions: Sequence[int]) -> None:
    """Write the rollouts of one step's `groups` (asyncpool Groups of molt Rollouts) into its file, each
    group named by its row's position in the stream (`positions`: by the pool's prompt index, as
    `molt._data.RowStream.positions`; a resumed run's pool numbers from 0 the rows it has not consumed)."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    with (dump_dir / f"step_{step:06d}.jsonl").open("wb") as out:
        for group in groups:
            row = positions[group.prompt_index]
            for index, rollout in enumerate(group.samples):
                segments = [msgspec.convert(msgspec.to_builtins(s), Segment) for s in rollout.segments]
                record = RolloutRecord(
                    step, row, index, rollout.reward, rollout.truncated, rollout.info, segments
                )
                out.write(msgspec.json.encode(record) + b"\n")


def read_rollouts(dump_dir: str | Path) -> Iterator[RolloutRecord]:
    """Every record under `dump_dir`, step by step, in the order they were trained."""
    decoder = msgspec.json.Decoder(RolloutRecord)
    paths = sorted(Path(dump_dir).glob("step_*.jsonl"))
    if not paths:
        raise ValueError(f"{dump_dir} holds no rollout dump (step_*.jsonl)")
    for path in paths:
        yield from decoder.decode_lines(path.read_bytes())
