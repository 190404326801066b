"""--algo.filters: each filter of `molt._filters.FILTERS` against groups built by hand, their composition
(in order, the first rejecting filter charged), the names the config accepts, and `take`'s bound on the
groups they drop, over a real GroupPool with a stand-in rollout (no engine)."""

from __future__ import annotations

import asyncio
import itertools
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import get_args

import molt_probes as probes
import pytest

from asyncpool import GroupPool
from molt._config_algo import FilterName
from molt._filters import FILTERS, GroupFilters
from molt._flags import resolve
from molt._restarts import EngineRestarts
from molt.config import ConfigError
from molt.loop import take


def group(prompt, rewards, truncated=()):
    """A finished group of `prompt`: one sample per reward, those whose index is in `truncated` cut at
    the token limit."""
    samples = [SimpleNamespace(reward=r, truncated=i in truncated) for i, r in enumerate(rewards)]
    return SimpleNamespace(prompt=prompt, samples=samples)


def test_the_filter_names_the_config_accepts_are_the_filters():
    assert list(get_args(FilterName)) == list(FILTERS)


@pytest.mark.parametrize(
    ("rewards", "keep"),
    [
        pytest.param([1.0, 0.0, 0.0], True, id="varying"),
        pytest.param([0.5, 0.5 + 1e-6], True, id="barely-varying"),
        pytest.param([1.0, 1.0, 1.0], False, id="all-solved"),
        pytest.param([0.0, 0.0], False, id="all-failed"),
        pytest.param([-0.5, -0.5], False, id="all-negative"),
        pytest.param([1.0], False, id="one-sample"),  # no baseline to differ from
        pytest.param([1, 0], True, id="int-rewards"),
    ],
)
def test_all_equal_rewards_keeps_only_a_group_whose_rewards_vary(rewards, keep):
    assert FILTERS["all_equal_rewards"](group("p", rewards)) is keep


@pytest.mark.parametrize(
    ("truncated", "keep"),
    [
        pytest.param((), True, id="none-truncated"),
        pytest.param((1,), False, id="one-truncated"),
        pytest.param((0, 1, 2), False, id="all-truncated"),
    ],
)
def test_truncated_rejects_a_group_with_a_sample_cut_at_the_token_limit(truncated, keep):
    assert FILTERS["truncated"](group("p", [1.0, 0.0, 1.0], truncated)) is keep


def test_a_group_is_kept_when_every_filter_keeps_it_and_charged_to_the_first_that_rejects_it():
    both = group("both", [1.0, 1.0], truncated=(0,))  # all-equal and truncated
    for names in (["all_equal_rewards", "truncated"], ["truncated", "all_equal_rewards"]):
        keep = GroupFilters(names, max_groups=8)
        assert keep(group("fine", [1.0, 0.0]))
        assert not keep(group("equal", [1.0, 1.0]))
        assert not keep(group("cut", [1.0, 0.0], truncated=(1,)))
        assert not keep(both)
        first, second = names
        assert keep.metrics() == {f"pool/filtered/{first}": 2.0, f"pool/filtered/{second}": 1.0}


def test_each_filters_rejections_are_counted_by_prompt():
    keep = GroupFilters(["all_equal_rewards"], max_groups=8)
    assert not keep(group("b", [1.0, 1.0, 1.0]))
    assert not keep(group("c", [0.0, 0.0]))
    assert not keep(group("c", [0.0, 0.0]))
    shown = keep.most_dropped()
    assert shown.startswith(
        "all_equal_rewards dropped 3 groups, most often 'c' (2 x, reward 0); 'b' (1 x, reward 1)"
    )
    assert "DAPO" in shown  # what the filter drops, from its docstring
    assert "'c' (2 x, reward 0); and 1 other prompts" in keep.most_dropped(limit=1)


@dataclass(frozen=True)
class _Sample:
    reward: float
    truncated: bool = False
    min_version: int = 0
    max_version: int = 0


async def _equal_rewards(prompt: dict, index: int) -> _Sample:
    """Every sample of an "easy" prompt gets reward 1, of the others alternately 0 and 1."""
    await asyncio.sleep(0)
    return _Sample(1.0 if prompt["easy"] else float(index % 2))


def _take_from(rows: list[dict], max_groups: int, names=("all_equal_rewards",), num_groups: int = 2):
    """`take` of a real GroupPool over `rows` (cycled), with --algo.filters `names` as its keep; tito is a
    stand-in holding the engines' liveness that `take` watches. A stall fails within 10 s instead of
    hanging."""

    async def main():
        keep = GroupFilters(names, max_groups)
        pool = GroupPool(_equal_rewards, itertools.cycle(rows), group_size=4, depth=4, keep=keep)
        tito = SimpleNamespace(router=SimpleNamespace(engines=[SimpleNamespace(alive=True)]))
        async with pool:
            attached = EngineRestarts(tito.router, [], None, max_restarts=0)  # none to restart
            return await asyncio.wait_for(take(pool, num_groups, tito, attached, keep), timeout=10)

    return asyncio.run(main())


def test_a_run_whose_groups_keep_being_dropped_stops_naming_the_filter_the_prompts_and_the_fix():
    with pytest.raises(RuntimeError) as error:
        _take_from(
            [{"id": "always-solved-3", "easy": True}], max_groups=20, names=("truncated", "all_equal_rewards")
        )
    message = str(error.value)
    assert "dropped by --algo.filters" in message and "more than 20" in message
    assert re.search(r"all_equal_rewards dropped \d+ groups, most often", message)
    assert "truncated dropped" not in message  # tried first, it dropped none
    assert "{'id': 'always-solved-3', 'easy': True} (" in message and "reward 1)" in message
    for flag in ("--algo.filter_max_batches", "--algo.filters", "--rollout.temperature"):
        assert flag in message


def test_groups_that_pass_are_taken_despite_the_ones_dropped():
    rows = [{"id": "easy", "easy": True}, {"id": "hard", "easy": False}]
    groups = _take_from(rows, max_groups=20)
    assert [group.prompt["id"] for group in groups] == ["hard", "hard"]


def test_each_step_logs_the_groups_each_filter_dropped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = ["--train.num_steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    config = resolve([*small, "--algo.filters", "truncated,all_equal_rewards"])
    metrics = probes.loop_run(config, tmp_path)["metrics"]  # stand-in rollouts whose groups all pass
    assert [
        (step["pool/filtered/truncated"], step["pool/filtered/all_equal_rewards"]) for step in metrics
    ] == [
        (0.0, 0.0),
        (0.0, 0.0),
    ]


def test_filters_compose_on_the_command_line_in_the_order_given():
    config = resolve(["--algo.filters", "truncated,all_equal_rewards", "--algo.filter_max_batches", "3"])
    assert (config.algo.filters, config.algo.filter_max_batches) == (["truncated", "all_equal_rewards"], 3)
    keep = GroupFilters.of(config)
    assert (keep.names, keep.max_groups) == (["truncated", "all_equal_rewards"], 3 * 16)
    assert GroupFilters.of(resolve([])) is None


def test_the_filters_bound_is_refused_without_a_filter_and_a_filter_twice_is_refused():
    with pytest.raises(ConfigError, match="--algo.filter_max_batches bounds .* none is on"):
        resolve(["--algo.filter_max_batches", "3"])
    with pytest.raises(ConfigError, match="--algo.filters names truncated twice"):
        resolve(["--algo.filters", "truncated,all_equal_rewards,truncated"])
    with pytest.raises(
        ConfigError, match=re.escape("--algo.filters: expected all_equal_rewards|truncated,...")
    ):
        resolve(["--algo.filters", "all_equal"])


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param("--algo.dynamic_filter", "--algo.filters all_equal_rewards", id="dynamic_filter"),
        pytest.param("--algo.dynamic_filter_max_batches", "--algo.filter_max_batches", id="max_batches"),
    ],
)
def test_the_renamed_flags_fail_naming_the_new_ones(old, new, tmp_path):
    with pytest.raises(ConfigError) as error:
        resolve([old, "true" if old.endswith("filter") else "3"])
    assert f"{old} was renamed: pass {new}" in str(error.value)
    file = tmp_path / "old.toml"
    file.write_text(f"[algo]\n{old.rsplit('.', 1)[1]} = true\n")
    with pytest.raises(ConfigError, match=f"key {old[2:]} in {file} was renamed: pass {new}"):
        resolve(["--config", str(file)])
