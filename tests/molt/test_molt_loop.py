"""The loop's own pieces: the token-identity check, rollout metrics, `take`'s order (over a real GroupPool
with a stand-in rollout: no engine; its bound on the groups --algo.filters drop is test_molt_filters'), data
rows, and the token-level pieces of GAE (where the reward sits, whitening, explained variance)."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, replace
from types import SimpleNamespace

import molt_probes as probes
import msgspec
import pytest
import torch

from asyncpool import GroupPool, PoolExhausted
from molt._batch import StepInputs, collate, with_lags
from molt._checkpoint import latest
from molt._data import read_rows
from molt._dumps import read_rollouts
from molt._flags import resolve
from molt._metrics import rollout_metrics, staleness_mean
from molt._objective import explained_variance, last_token_rewards, rollout_sums, whitened
from molt._restarts import EngineRestarts
from molt._rollout import Rollout
from molt.agent import load_agent
from molt.config import Config, Data
from molt.loop import NO_UPDATE_STEPS, check_token_identity, check_updates, refit_engines, take, train_windows
from tito import Segment


def _attached(tito) -> EngineRestarts:
    """The restarts of engines molt did not start (`--vllm.urls`): none."""
    return EngineRestarts(tito.router, [], None, max_restarts=0)


def rollout(tokens, mask, versions, reward=1.0, sampled=None) -> Rollout:
    segment = Segment(tokens, mask, [-0.5 if m else 0.0 for m in mask], versions)
    trained = [t for t, m in zip(tokens, mask, strict=True) if m]
    return Rollout([segment], reward, trained if sampled is None else sampled, truncated=False)


def batch_of(rollouts):
    rows = [(s.token_ids, s.loss_mask, s.logprobs, 1.0) for r in rollouts for s in r.segments]
    return collate(rows, pad_id=0)


def test_token_identity_holds_for_the_engines_tokens():
    rollouts = [
        rollout([1, 2, 7, 8], [0, 0, 1, 1], [-1, -1, 0, 0]),
        rollout([1, 3, 9], [0, 0, 1], [-1, -1, 0]),
    ]
    check_token_identity(batch_of(rollouts), rollouts)


def test_token_identity_violation_is_a_hard_failure():
    good = rollout([1, 2, 7, 8], [0, 0, 1, 1], [-1, -1, 0, 0])
    retokenized = rollout([1, 2, 7, 8], [0, 0, 1, 1], [-1, -1, 0, 0], sampled=[7, 5])
    with pytest.raises(RuntimeError, match="token identity violated in rollout 1"):
        check_token_identity(batch_of([good, retokenized]), [good, retokenized])


def test_rollout_metrics_and_staleness():
    rollouts = [
        rollout([1, 7], [0, 1], [-1, 3], reward=1.0),
        rollout([1, 7, 8], [0, 1, 1], [-1, 2, 3], reward=0.0),
        rollout([1, 7], [0, 1], [-1, 3], reward=0.0),
        rollout([1, 7], [0, 1], [-1, 3], reward=0.0),
    ]
    metrics = rollout_metrics(rollouts, group_size=2)
    assert metrics["rollout/reward_mean"] == 0.25
    assert metrics["rollout/reward_std_in_group"] == pytest.approx(0.25)  # groups (1, 0) and (0, 0)
    assert metrics["rollout/response_len_mean"] == 1.25
    assert staleness_mean(rollouts, trainer_version=3) == pytest.approx(1 / 5)  # one of 5 tokens is 1 behind


def test_each_trainable_tokens_lag_is_the_trainers_version_minus_the_engines():
    rollouts = [rollout([1, 7, 8], [0, 1, 1], [-1, 2, 3]), rollout([1, 7], [0, 1], [-1, 3])]
    batch = with_lags(
        batch_of(rollouts), [s.versions for r in rollouts for s in r.segments], trainer_version=3
    )
    assert batch.lag_BT.tolist() == [[0, 1, 0], [0, 0, 0]]  # 0 on prompts and padding
    assert batch.select([0]).lag_BT.tolist() == [[0, 1, 0]] and batch.select([]).lag_BT.tolist() == [[0]]


@dataclass(frozen=True)
class _Sample:
    reward: float
    min_version: int = 0
    max_version: int = 0


def test_a_steps_groups_come_in_prompt_order_whichever_finished_first():
    async def later_prompts_first(prompt: int, index: int) -> _Sample:
        await asyncio.sleep(0.02 * (4 - prompt))  # prompt 3's group completes first, prompt 0's last
        return _Sample(float(index))

    async def main():
        pool = GroupPool(later_prompts_first, iter(range(4)), group_size=2, depth=4)
        tito = SimpleNamespace(router=SimpleNamespace(engines=[SimpleNamespace(alive=True)]))
        async with pool:
            return await asyncio.wait_for(take(pool, 4, tito, _attached(tito)), timeout=10)

    assert [group.prompt for group in asyncio.run(main())] == [0, 1, 2, 3]


def test_rows_come_from_jsonl_reshuffled_each_epoch(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": str(i)}], "i": i}) + "\n"
                            for i in range(3)))  # fmt: skip
    config = msgspec.structs.replace(Config(), data=Data(path=str(path), messages_key="prompt"))
    rows = read_rows(config, agent_module=None)
    first_epoch = [next(rows) for _ in range(3)]
    assert sorted(row["i"] for row in first_epoch) == [0, 1, 2]
    assert all(row["messages"] == [{"role": "user", "content": str(row["i"])}] for row in first_epoch)
    assert sorted(next(rows)["i"] for _ in range(3)) == [0, 1, 2]  # the next epoch, reshuffled


def test_rows_without_the_messages_field_are_refused_before_any_is_drawn(tmp_path):
    # `launch` calls read_rows before Ray starts; the pool draws the first row only once engines are up
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "x"}) + "\n")
    config = msgspec.structs.replace(Config(), data=Data(path=str(path)))
    with pytest.raises(ValueError, match="needs a 'messages' field"):
        read_rows(config, agent_module=None)


def _rows(*lengths: int) -> list[tuple[list[int], list[int], list[float], float]]:
    """Rows of `lengths` tokens, the first two a prompt, the rest trainable."""
    return [(list(range(1, n + 1)), [0, 0] + [1] * (n - 2), [-1.0] * n, 1.0) for n in lengths]


def test_windows_split_whole_rollouts_each_with_its_own_denominator():
    # 5 rollouts, the third compacted into two rows, the last with no trainable token
    sequences = _rows(6, 7, 8, 9, 10, 6)
    token_ids, loss_mask, logprobs, advantage = sequences[5]
    sequences[5] = (token_ids, [0] * len(loss_mask), logprobs, advantage)
    batch = collate(sequences, pad_id=0)
    per_rollout = [1, 1, 2, 1, 1]
    windows = batch.windows(2, per_rollout, seed=(0, 1))
    owner = [0, 1, 2, 2, 3, 4]  # the rollout of each row
    seen = [row for _, rows in windows for row in rows]
    assert sorted(seen) == list(range(6))
    for window, rows in windows:  # whole rollouts; each window is one step: its own tokens and sequences
        assert all(
            owner.count(r) == [owner[row] for row in rows].count(r) for r in {owner[row] for row in rows}
        )
        assert window.num_tokens == int(batch.loss_mask_BT[rows].sum())
        assert window.num_seqs == int((batch.loss_mask_BT[rows] != 0).any(dim=1).sum())
        num_cols = window.tokens_BT.shape[1]  # the window's longest row
        torch.testing.assert_close(window.tokens_BT, batch.tokens_BT[rows, :num_cols])
    assert sum(w.num_tokens for w, _ in windows) == batch.num_tokens
    assert sum(w.num_seqs for w, _ in windows) == batch.num_seqs == 5
    whole = batch.windows(1, per_rollout, seed=(0, 1))[0][0]
    assert (whole.num_tokens, whole.num_seqs) == (batch.num_tokens, batch.num_seqs)
    fewer = batch.windows(6, per_rollout, seed=(0, 1))  # more windows than rollouts: one per rollout
    assert sorted(rows for _, rows in fewer) == [[0], [1], [2, 3], [4], [5]]


def test_windows_are_a_seeded_permutation_of_rollouts_not_completion_order():
    batch = collate(_rows(*[6] * 16), pad_id=0)
    firsts = {seed: batch.windows(2, [1] * 16, seed)[0][1] for seed in [(0, step) for step in range(1, 6)]}
    assert all(rows != list(range(8)) for rows in firsts.values())  # not the 8 that finished first
    assert len({tuple(sorted(rows)) for rows in firsts.values()}) == 5  # each step draws anew
    assert batch.windows(2, [1] * 16, (0, 3))[0][1] == firsts[(0, 3)]  # the same seed, the same windows
    assert batch.windows(2, [1] * 16, (1, 3))[0][1] != firsts[(0, 3)]  # --train.seed changes them


def test_clip_fractions_are_over_the_windows_after_the_first():
    """Window 1's ratio is 1 (its clip fraction 0): the reported fraction is over windows 2..N, token-
    weighted; the other metrics are over all windows."""
    batch = collate(_rows(6, 6, 10, 10, 6, 6), pad_id=0)
    windows = batch.windows(3, [1] * 6, (0, 1))
    clip = iter([0.0, 0.2, 0.5])
    loss = iter([1.0, 2.0, 3.0])
    group = SimpleNamespace(
        train_step=lambda window, inputs: {"train/clip_frac": next(clip), "train/x": next(loss)}
    )
    metrics = train_windows(group, windows)
    tokens = [window.num_tokens for window, _ in windows]
    assert metrics["train/clip_frac"] == pytest.approx((0.2 * tokens[1] + 0.5 * tokens[2]) / sum(tokens[1:]))
    assert metrics["train/x"] == pytest.approx((tokens[0] + 2 * tokens[1] + 3 * tokens[2]) / sum(tokens))
    one = train_windows(SimpleNamespace(train_step=lambda w, inputs: {"train/clip_frac": 0.0}), windows[:1])
    assert one["train/clip_frac"] == 0.0  # one window: the ratio is 1, nothing clips


def test_skipped_updates_are_counted_over_the_windows():
    batch = collate(_rows(6, 6, 10, 10, 6, 6), pad_id=0)
    windows = batch.windows(3, [1] * 6, (0, 1))
    skipped = iter([1.0, 0.0, 1.0])
    group = SimpleNamespace(train_step=lambda window, inputs: {"train/skipped_updates": next(skipped)})
    assert train_windows(group, windows)["train/skipped_updates"] == 2.0


def test_steps_without_an_update_stop_the_run_naming_them_and_their_losses(caplog):
    """A step whose updates were all skipped (non-finite gradient norms) warns; `NO_UPDATE_STEPS` of them
    in a row stop the run; a step that updated anything starts the count again."""
    nothing = {"train/skipped_updates": 2.0, "train/policy_loss": float("nan"), "train/entropy": float("nan")}
    assert check_updates(1, {"train/skipped_updates": 0.0}, 2, None) is None
    assert check_updates(2, {**nothing, "train/skipped_updates": 1.0}, 2, None) is None  # one went through
    assert "step 2: train/skipped_updates 1 of 2" in caplog.text
    since = None
    for step in range(3, 3 + NO_UPDATE_STEPS - 1):
        since = check_updates(step, nothing, 2, since)
        assert since == 3
    with pytest.raises(RuntimeError, match=r"every update of the policy was skipped.*policy_loss nan"):
        check_updates(3 + NO_UPDATE_STEPS - 1, nothing, 2, since)
    assert check_updates(3 + NO_UPDATE_STEPS, {"train/skipped_updates": 0.0}, 2, since) is None
    critic = {"train/skipped_updates": 0.0, "critic/skipped_updates": 1.0, "critic/value_loss": float("inf")}
    since = None
    for step in range(10, 10 + NO_UPDATE_STEPS - 1):
        since = check_updates(step, critic, 1, since)
    last = 10 + NO_UPDATE_STEPS - 1
    with pytest.raises(
        RuntimeError,
        match=rf"steps 10..{last}: every update of the critic was skipped.*critic/value_loss inf.*step 9's",
    ):
        check_updates(last, critic, 1, since)


def test_each_window_gets_its_own_rows_of_every_named_input():
    batch = collate(_rows(6, 6, 10, 10, 6, 6), pad_id=0)
    windows = batch.windows(2, [2, 1, 2, 1], (0, 3))  # rollouts of 2, 1, 2 and 1 rows
    values_BT = torch.arange(batch.tokens_BT.numel(), dtype=torch.float32).reshape(batch.tokens_BT.shape)
    inputs = StepInputs(old_values_BT=values_BT, returns_BT=-values_BT)  # the others stay None
    seen = []
    train_windows(SimpleNamespace(train_step=lambda w, given: seen.append(given) or {}), windows, inputs)
    for (window, rows), given in zip(windows, seen, strict=True):
        assert given.old_logp_BT is None and given.ref_logp_BT is None
        assert torch.equal(given.old_values_BT, values_BT[rows, : window.tokens_BT.shape[1]])
        assert torch.equal(given.returns_BT, -values_BT[rows, : window.tokens_BT.shape[1]])
    assert sorted(row for _, rows in windows for row in rows) == list(range(6))


def test_rollout_sums_add_each_rollouts_segments():
    values_BT = torch.tensor([[0.5, 1.0], [2.0, 0.0], [0.25, 0.25]])  # rows: one, two (a compacted one x2)
    assert rollout_sums(values_BT, torch.tensor([1, 2])).tolist() == [1.5, 2.5]


def test_gae_rewards_sit_on_each_rows_last_trainable_token():
    mask_BT = torch.tensor([[0.0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    rewards_BT = last_token_rewards(mask_BT, torch.tensor([2.0, -1.0, 5.0]))
    expected = torch.zeros_like(mask_BT)
    expected[0, 4], expected[1, 3] = 2.0, -1.0  # a row with nothing to train gets no reward
    assert torch.equal(rewards_BT, expected)


def test_whitening_uses_trainable_tokens_only():
    mask_BT = torch.tensor([[0.0, 1, 1], [0, 1, 0]])
    values_BT = torch.tensor([[100.0, 1, 2], [-50, 3, 7]])
    out_BT = whitened(values_BT, mask_BT)
    trained = out_BT[mask_BT != 0]
    assert trained.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert trained.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(out_BT[mask_BT == 0], torch.zeros(3))


def test_explained_variance():
    mask_BT = torch.tensor([[0.0, 1, 1, 1]])
    returns_BT = torch.tensor([[9.0, 1, 2, 3]])
    assert explained_variance(returns_BT, returns_BT, mask_BT) == pytest.approx(1.0)  # a perfect critic
    assert explained_variance(torch.full_like(returns_BT, 2.0), returns_BT, mask_BT) == pytest.approx(0.0)
    assert explained_variance(-returns_BT, returns_BT, mask_BT) < 0  # worse than a constant
    assert explained_variance(returns_BT, torch.ones_like(returns_BT), mask_BT) == 0.0  # returns constant


class _LosingPolicy:
    """A policy group whose refit fails on the engines in `dead` (the real one raises `EnginesLost`)."""

    def __init__(self, dead: set[str]) -> None:
        self.dead, self.asked = dead, []

    def refit(self, urls, version):
        from molt._group import EnginesLost

        self.asked.append(list(urls))
        failed = {url: "pause: ConnectionRefusedError" for url in urls if url in self.dead}
        if failed:
            raise EnginesLost(failed, updated=[url for url in urls if url not in failed])


def test_an_engine_that_fails_a_refit_is_dropped_and_the_run_goes_on():
    engines = [SimpleNamespace(url=url, alive=True) for url in ("http://a", "http://b")]
    tito = SimpleNamespace(router=SimpleNamespace(engines=engines))
    policy, restarts = _LosingPolicy(dead={"http://b"}), _attached(tito)
    asyncio.run(refit_engines(policy, tito, 3, restarts))
    assert [e.alive for e in engines] == [True, False]
    asyncio.run(refit_engines(policy, tito, 4, restarts))  # the dropped engine is not asked again
    assert policy.asked == [["http://a", "http://b"], ["http://a"]]

    policy.dead.add("http://a")
    with pytest.raises(RuntimeError, match="no vLLM engine took the weights of step 5"):
        asyncio.run(refit_engines(policy, tito, 5, restarts))


class _EngineDiesUnderTheNextBatch(probes._Rollouts):
    """The first `served` rollouts are served; then the only engine dies and is up again at once, waiting
    for the weights (`molt._restarts`): a rollout on it waits until it serves, as `RolloutRunner` does,
    then raises for the pool to retry it."""

    def __init__(self, served: int) -> None:
        super().__init__()
        self.served, self.died = served, False

    async def __call__(self, row: dict, index: int) -> Rollout:
        assert self.restarts is not None
        engine = self.restarts.router.engines[0]
        if not self.served and not self.died:
            self.died, engine.alive, self.restarts.stale = True, False, [0]
        if not engine.alive:
            await self.restarts.serving()
            raise ConnectionError("the engine died")
        self.served -= 1
        return await super().__call__(row, index)


def test_a_refit_without_partial_rollout_does_not_wait_for_rollouts_no_engine_serves(tmp_path, monkeypatch):
    """--rollout.partial_rollout false holds the refit until the running rollouts finish; those waiting for
    a dead engine sample nothing until it is back, which the next take does (with the new weights)."""
    monkeypatch.chdir(tmp_path)
    small = ["--train.num_steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    config = resolve([*small, "--rollout.partial_rollout", "false"])
    run = probes.loop_run(config, tmp_path, _EngineDiesUnderTheNextBatch(served=2 * 2))
    assert [(m["step"], m["engines/alive"]) for m in run["metrics"]] == [(1, 0.0), (2, 1.0)]
    assert run["refits"] == [False, True]  # brought back in step 2's take, then step 2's refit


def test_an_engine_up_again_during_evaluation_gets_the_weights_and_serves(tmp_path, monkeypatch):
    """The only engine dies under the next batch and is up again before the evaluation, whose samples
    wait for it to serve: the evaluation brings it back (the actor is idle, at the pool's version)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"messages": f"q{i}"}) + "\n" for i in range(2)))
    small = ["--train.num_steps", "1", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    config = resolve([*small, "--eval.every", "1", "--eval.path", str(tmp_path / "eval.jsonl")])
    run = probes.loop_run(config, tmp_path, _EngineDiesUnderTheNextBatch(served=2 * 2))
    failed = [(m["step"], m["eval/failed"]) for m in run["metrics"]]
    assert failed == [(1, 2 * 4)]  # each sample met the dead engine, and raised once it was back
    assert run["refits"] == [False]  # brought back during the evaluation, as version 1


FINITE_AGENT = """
from molt.agent import Env, Result


def dataset(seed):
    for n in range(3):
        yield {"messages": [{"role": "user", "content": f"row {n}"}]}


class AgentRunner(Env):
    def reset(self, sample):
        return "say it"

    def step(self, action):
        return Result(reward=1.0)
"""


def test_the_last_batch_of_a_used_up_dataset_trains_in_as_many_windows_as_it_has_rollouts(
    tmp_path, monkeypatch
):
    """Three rows, two groups of two a step, four windows a step: the second step's batch is the last
    group alone (the pool returns fewer groups once the rows are used up), two rollouts in two windows."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "finite.py").write_text(FINITE_AGENT)
    small = ["--train.num_steps", "3", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    config = resolve([*small, "--train.mini_batches", "4", "--agent.module", str(tmp_path / "finite.py")])
    with pytest.raises(PoolExhausted):  # at step 3's take: the run stops there (`molt._launch`)
        probes.loop_run(config, tmp_path)
    (log,) = tmp_path.glob("runs/*/metrics.jsonl")
    lines = log.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_a_resumed_runs_dumps_name_each_groups_row_by_its_position_in_the_stream(tmp_path, monkeypatch):
    """Rows 0 and 2 were trained before the checkpoint: the resumed run's pool numbers the rows it draws
    from 0, but a dump names the row as the stream (and the checkpoint's trained rows) do."""
    monkeypatch.chdir(tmp_path)
    small = ["--train.num_steps", "1", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    config = resolve([*small, "--train.rollout_dump_dir", str(tmp_path / "dumps")])
    probes.loop_run(config, tmp_path, skip=[0, 2])
    assert sorted({record.group for record in read_rollouts(tmp_path / "dumps")}) == [1, 3]


class _SolvedWords(probes._Rollouts):
    """The stand-in rollout, but every sample of a row whose word is in `solved` gets reward 1: an
    all-correct group, which --algo.filters all_equal_rewards drops."""

    def __init__(self, solved: set[str]) -> None:
        super().__init__()
        self.solved = solved

    async def __call__(self, row: dict, index: int) -> Rollout:
        rollout = await super().__call__(row, index)
        return replace(rollout, reward=1.0) if row["word"] in self.solved else rollout


def test_a_checkpoint_records_the_rows_the_filters_dropped_with_the_trained_ones(tmp_path, monkeypatch):
    """Two words of the stream are always solved, so the filter drops their groups: an uninterrupted run
    never draws those rows again, so a run resumed from the checkpoint must skip them as it skips the
    trained ones; the rows still in the pool, drawn but neither trained nor dropped, it draws again."""
    monkeypatch.chdir(tmp_path)
    small = ["--train.num_steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    config = resolve([*small, "--algo.filters", "all_equal_rewards", "--ckpt.every", "2"])
    stream = list(itertools.islice(read_rows(config, load_agent(config.agent.module)), 20))
    solved = {stream[0]["word"], stream[2]["word"]}
    probes.loop_run(config, tmp_path, _SolvedWords(solved))
    (ckpt_dir,) = tmp_path.glob("runs/*/checkpoints")
    recorded = latest(ckpt_dir)[1].consumed_rows
    dropped = {position for position, row in enumerate(stream) if row["word"] in solved}
    trained = [position for position in range(len(stream)) if position not in dropped][: 2 * 2]
    assert [position for position in recorded if position not in dropped] == trained
    assert {position for position in dropped if position < trained[-1]} <= set(recorded)


def test_max_lag_0_trains_no_group_of_an_older_version_from_the_first_step_on(tmp_path, monkeypatch):
    """--rollout.max_lag 0 with the default queue of two steps' groups: the pool knows from the start how
    many groups a step takes, so its first fill starts one step's, not two (the second of which step 2
    trained one version late)."""
    monkeypatch.chdir(tmp_path)
    flags = ["--train.num_steps", "3", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
             "--rollout.max_lag", "0", "--rollout.partial_rollout", "false"]  # fmt: skip
    result = probes.loop_run(resolve(flags), tmp_path)
    assert [step["train/staleness_mean"] for step in result["metrics"]] == [0.0, 0.0, 0.0]
    assert [step["pool/kept_stale"] for step in result["metrics"]] == [0.0, 0.0, 0.0]


def test_the_first_steps_wait_runs_the_warm_up_the_engines_left_and_no_later_one_does(tmp_path, monkeypatch):
    """While the first groups come, the policy, then the frozen policy groups, run the compile warm-up
    passes the engines' start-up left (`loop.warm_up_while`, until done or the groups are there): before
    the first optimizer step, and never after. The stand-in groups come at once: the policy's first pass,
    begun before they were seen, is sure to run; what runs after it depends on when they came."""
    monkeypatch.chdir(tmp_path)
    flags = ["--train.num_steps", "3", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
             "--algo.kl.coef", "0.01"]  # fmt: skip
    warm_ups = probes.loop_run(resolve(flags), tmp_path, warm_ups=True)["warm_ups"]
    assert len(warm_ups["policy"]) >= 1
    for name, before_step in warm_ups.items():  # the policy's and the reference's
        assert len(before_step) <= 2 and set(before_step) <= {0}, name


def test_a_checkpoint_written_before_rows_were_counted_consumed_still_resumes(tmp_path):
    """loop.json keeps the key older checkpoints wrote (`trained_rows`), so a run they saved resumes."""
    from molt._checkpoint import latest

    (tmp_path / "step_000002").mkdir()
    (tmp_path / "latest").write_text("step_000002\n")
    old = {"step": 2, "trained_rows": [0, 1, 3], "torch_rng": [0], "python_rng": [3, [1, 2], None]}
    (tmp_path / "step_000002" / "loop.json").write_text(json.dumps(old))
    assert latest(tmp_path)[1].consumed_rows == [0, 1, 3]
