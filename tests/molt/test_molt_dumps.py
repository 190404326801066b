"""Rollout dumps: what the loop writes for each step reads back, token for token, with its reward."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import molt
from molt._dumps import write_rollouts
from molt._rollout import Rollout
from tito import Segment


@dataclass
class Group:
    prompt_index: int
    samples: list[Rollout]


def test_dumped_rollouts_read_back_exactly(tmp_path):
    compacted = Rollout([Segment([1, 2, 7], [0, 0, 1], [0.0, 0.0, -0.25], [-1, -1, 3]),
                         Segment([1, 5, 8, 9], [0, 0, 1, 1], [0.0, 0.0, -1.5, -0.125], [-1, -1, 3, 4])],
                        reward=1.0, sampled=[7, 8, 9], truncated=False, info={"tool_calls": 2.0})  # fmt: skip
    plain = Rollout([Segment([1, 3, 6], [0, 0, 1], [0.0, 0.0, -0.5], [-1, -1, 4])], reward=0.0,
                    sampled=[6], truncated=True)  # fmt: skip
    positions = [0, 1, 2, 3, 4, 5, 6, 17, 18, 19]  # the rows' positions in the stream, by pool index
    write_rollouts(tmp_path, 1, [Group(7, [compacted, plain])], positions)
    write_rollouts(tmp_path, 2, [Group(9, [plain])], positions)

    records = list(molt.read_rollouts(tmp_path))
    assert [(r.step, r.group, r.sample, r.reward, r.truncated) for r in records] == [
        (1, 17, 0, 1.0, False), (1, 17, 1, 0.0, True), (2, 19, 0, 0.0, True),
    ]  # fmt: skip
    assert records[0].info == {"tool_calls": 2.0}
    for record, rollout in zip(records, [compacted, plain, plain], strict=True):
        assert [(s.token_ids, s.loss_mask, s.logprobs, s.versions) for s in record.segments] == [
            (s.token_ids, s.loss_mask, s.logprobs, s.versions) for s in rollout.segments
        ]


def test_reading_a_directory_without_dumps_says_so(tmp_path):
    with pytest.raises(ValueError, match="holds no rollout dump"):
        next(molt.read_rollouts(tmp_path))
