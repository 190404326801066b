"""Compiled layers warm up at start-up (`molt._actor.PolicyWorker._warm_up`): their graphs are built before
the first step, from dummy rows of each layout at two sizes, and nothing of it stays behind: the weights as
loaded, no optimizer state, no gradient, no pass counted, and the first step the same as without it.

The CPU runs the compiled layers too (torch.compile's CPU backend, with graph breaks around the CPU's
per-row attention), which is enough to see what the warm-up leaves; what it saves is measured on a GPU.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import torch

from molt._actor import _warm_up_batches
from molt._batch import collate
from molt._prefix import MIN_SHARED_TOKENS, SharedPrefixRows
from molt.config import Actor, Config, Rollout
from molt.vllm_server import free_port


@pytest.mark.parametrize("budget", [64, 512, 2048, 49152])
def test_the_warm_up_rows_take_each_layout_at_two_sizes_within_the_budget(budget):
    by_layout = _warm_up_batches(1000, budget, trees=True)
    assert list(by_layout) == ["trees", "packed", "one length"]  # a group's replies share their prompt
    assert list(_warm_up_batches(1000, budget, trees=False)) == ["packed", "one length"]
    batches = [*by_layout["packed"], *by_layout["one length"], *by_layout["trees"]]
    assert [len(pair) for pair in by_layout.values()] == [2, 2, 2]
    layouts = [SharedPrefixRows.of(batch.tokens_BT, batch.row_lengths) for batch in batches]
    assert all(max(batch.row_lengths) <= budget for batch in batches)
    assert [layout.num_saved for layout in layouts[:4]] == [0] * 4  # rows of their own, none shared
    assert [len(set(batch.row_lengths)) > 1 for batch in batches[:4]] == [True, True, False, False]
    if min(budget, 1024) // 8 > MIN_SHARED_TOKENS:  # a prefix long enough to share
        assert all(layout.num_saved > 0 for layout in layouts[4:])
    # packed, [B, T] (rows of one length) and trees: the second size differs in every dimension
    for first, second in (batches[0:2], batches[2:4], batches[4:6]):
        assert first.num_rows != second.num_rows
        assert max(first.row_lengths) != max(second.row_lengths)
        packed = [-(-sum(batch.row_lengths) // 256) for batch in (first, second)]  # CUDA's rounding
        assert packed[0] != packed[1] or budget < 1024


# AutoModel's imports in this process (a Ray worker's would not reach the test) and Dynamo as it traces
# torch's and AutoModel's internals (a non-leaf's .grad read, an autograd Function instantiated) warn about
# code that is not this project's: shown, not raised.
@pytest.mark.slow
@pytest.mark.filterwarnings("default")
def test_compiled_layers_are_built_at_start_and_leave_the_first_step_as_without(tiny_model_dir, capfd):
    from molt._actor import PolicyWorker
    from molt._rank import compiled_graphs

    batch = collate(
        [
            ([1, 5, 9, 11, 12], [0, 0, 0, 1, 1], [-4.0] * 5, 1.0),
            ([1, 6, 7, 13], [0, 0, 1, 1], [-4.0] * 4, -1.0),
        ],
        pad_id=0,
    )
    # later: graphs built after the first step by a pass over rows of one length, at a size not seen. (Packed
    # rows of a new count recompile on the CPU alone: its per-row attention loops in Python, where CUDA's
    # varlen kernel takes the row bounds as a tensor; the GPU tests count those.)
    results, later, warm_up_s = [], [], []
    for compiled in ("off", "on"):  # --actor.compile on is refused on a CPU run; the worker takes it here
        actor = Actor(lr=1e-2, micro_batch_tokens=256, compile=compiled, shared_prefix="off")
        config = msgspec.structs.replace(Config(), actor=actor, rollout=Rollout(temperature=0.7))
        before = compiled_graphs()
        try:
            worker = PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
            built = compiled_graphs() - before
            counts = worker.take_pass_counts()
            assert worker.optimizer is not None and worker.scheduler is not None
            left = (len(worker.optimizer.state), sum(p.grad is not None for p in worker.model.parameters()))
            loaded = {name: p.detach().clone() for name, p in worker.model.named_parameters()}
            warm_up_s.append(worker.startup_seconds()["warm_up"])
            results.append(
                (built, counts, left, loaded, worker.scheduler.last_epoch, worker.train_step(batch))
            )
            after_step = compiled_graphs()  # rows of one length, a size no pass ran: a [B, T] batch
            worker.logprobs(collate([([1, *range(3, 9)], [0] + [1] * 6, [0.0] * 7, 0.0)] * 4, pad_id=0))
            later.append(compiled_graphs() - after_step)
        finally:
            torch.distributed.destroy_process_group()
            torch._dynamo.reset()
    (eager_built, _, eager_left, eager_loaded, eager_epoch, eager_metrics), compiled = results
    built, counts, left, loaded, epoch, metrics = compiled
    assert eager_built == 0 and built > 0  # the graphs exist before the first step
    assert warm_up_s[0] < 0.05 < warm_up_s[1]  # the start-up's `actor_warm_up` times the compiling
    assert "compile warm-up: packed " in capfd.readouterr().out  # and the rank's log says where it went
    assert later == [0, 0]  # and serve later sizes: no recompile in a later step
    assert counts["tokens"] == counts["slots"] == counts["compiles"] == 0  # the warm-up is no step's work
    assert left == eager_left == (0, 0) and epoch == eager_epoch  # no optimizer state, gradient or step
    for name, value in eager_loaded.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0)  # the weights as loaded
    for name, value in eager_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-3, abs=1e-5), name


@pytest.mark.slow
@pytest.mark.filterwarnings("default")
def test_layers_sharing_a_one_rank_unit_build_the_graphs_a_unit_each_builds(tiny_model_dir, monkeypatch):
    """bf16 compute over float32 weights on one rank (`molt._sharding.shard_one_rank`): the tiny model's
    two layers share a unit, and the second layer's inputs must reach its compiled graph as the first's
    do (cast, and as views), or every graph is built twice."""
    from molt import _sharding
    from molt._actor import PolicyWorker
    from molt._rank import compiled_graphs
    from molt.config import Model

    built = []
    for unit_bytes in (_sharding.UNIT_BYTES, 0):  # one unit for both layers; a unit each
        monkeypatch.setattr(_sharding, "UNIT_BYTES", unit_bytes)
        actor = Actor(
            lr=1e-2, micro_batch_tokens=256, compile="on", shared_prefix="off", compute_dtype="bfloat16"
        )
        config = msgspec.structs.replace(Config(), model=Model(dtype="float32"), actor=actor)
        before = compiled_graphs()
        try:
            PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config)
            built.append(compiled_graphs() - before)
        finally:
            torch.distributed.destroy_process_group()
            torch._dynamo.reset()
    grouped, alone = built
    assert grouped == alone > 0


@pytest.mark.slow
@pytest.mark.filterwarnings("default")
def test_the_warm_up_stops_once_the_engines_are_up(tiny_model_dir, capfd):
    """The warm-up only fills the engines' loading time: with them up before it begins, it builds nothing
    and says which layouts the steps will compile when they meet them."""
    import ray

    from molt._actor import PolicyWorker, engines_up
    from molt._rank import compiled_graphs

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        loading = ray.remote(lambda: time.sleep(300)).remote()  # an engine that has not answered yet
        answered = ray.put("http://127.0.0.1:8000")
        assert not engines_up([answered, loading]) and engines_up([answered]) and engines_up([])
        actor = Actor(lr=1e-2, micro_batch_tokens=256, compile="on", shared_prefix="off")
        config = msgspec.structs.replace(Config(), actor=actor)
        before = compiled_graphs()
        worker = PolicyWorker(
            0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config, engines_loading=[answered]
        )
        assert compiled_graphs() == before and worker.startup_seconds()["warm_up"] < 0.05
        said = capfd.readouterr().out
        assert "stopped, the engines are up (packed, one length: built while the first groups come)" in said
        ray.cancel(loading, force=True)
    finally:
        torch.distributed.destroy_process_group()
        torch._dynamo.reset()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.filterwarnings("default")
def test_the_warm_up_stops_before_the_next_pass_not_the_next_layout(tiny_model_dir, capfd, monkeypatch):
    """Engines that come up while a layout compiles stop the warm-up before that layout's next pass: on
    one H100 a run that began a layout 2 s before its engine answered, and finished it, began its first
    step 10 s later."""
    from molt import _actor
    from molt._rank import compiled_graphs

    answers = iter([False])  # not up at the first pass, up from the second on
    monkeypatch.setattr(_actor, "engines_up", lambda refs: next(answers, True))
    actor = Actor(lr=1e-2, micro_batch_tokens=256, compile="on", shared_prefix="off")
    config = msgspec.structs.replace(Config(), actor=actor)
    before = compiled_graphs()
    try:
        _actor.PolicyWorker(0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config, engines_loading=[])
        built = compiled_graphs() - before
    finally:
        torch.distributed.destroy_process_group()
        torch._dynamo.reset()
    said = capfd.readouterr().out
    assert built > 0  # the first pass ran: the packed rows' logprobs
    assert (
        "compile warm-up: packed " in said
        and "graphs (1 of 4 passes); stopped, the engines are up (packed, one length" in said
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("default")
def test_the_warm_up_the_engines_stopped_goes_on_while_the_first_groups_come(
    tiny_model_dir, capfd, monkeypatch
):
    """The passes the engines' start-up left run while the trainer waits for its first groups
    (`molt.loop.warm_up_while`), one at a time: past the groups' arrival only the pass under way, and all
    of them while the groups are late. A later step then meets its layouts built, and counts none of it."""
    from molt import _actor
    from molt._rank import compiled_graphs
    from molt.loop import warm_up_while

    monkeypatch.setattr(_actor, "engines_up", lambda refs: True)  # up before the warm-up began
    actor = Actor(lr=1e-2, micro_batch_tokens=256, compile="on", shared_prefix="off")
    config = msgspec.structs.replace(Config(), actor=actor)
    try:
        worker = _actor.PolicyWorker(
            0, 1, "127.0.0.1", free_port(), str(tiny_model_dir), config, engines_loading=[]
        )
        before, passes = compiled_graphs(), len(worker.warm_up_left)
        assert passes == 8  # packed rows and rows of one length, two sizes each, logprobs and train step
        # groups there at once: the pass begun before they were seen ends, and no other runs
        assert asyncio.run(warm_up_while(asyncio.sleep(0, result="groups"), worker)) == "groups"
        assert len(worker.warm_up_left) == passes - 1

        async def late_groups() -> str:  # they come once the warm-up has nothing left
            while worker.warm_up_left:
                await asyncio.sleep(0.01)
            return "groups"

        assert asyncio.run(warm_up_while(late_groups(), worker)) == "groups"
        built = compiled_graphs() - before
        counts = worker.take_pass_counts()
        after_warm_up = compiled_graphs()  # rows of one length, a size no pass ran: a [B, T] batch
        worker.logprobs(collate([([1, *range(3, 9)], [0] + [1] * 6, [0.0] * 7, 0.0)] * 4, pad_id=0))
        later = compiled_graphs() - after_warm_up
    finally:
        torch.distributed.destroy_process_group()
        torch._dynamo.reset()
    assert built > 0 and later == 0  # built while waiting, not in the step
    assert counts["tokens"] == counts["slots"] == counts["compiles"] == 0  # and no step's work
    said = capfd.readouterr().out
    assert "compile warm-up: stopped, the engines are up (packed, one length: built while" in said
    assert "compile warm-up, while the first groups come: one length " in said and "(0 passes left)" in said


def warm_up_rank(rank: int, world_size: int, port: int, model_dir: str, out: dict) -> None:
    """One rank of a compiling policy (gloo, CPU) whose engines rank 0 sees up and rank 1 does not."""
    from molt import _actor
    from molt._rank import compiled_graphs

    _actor.engines_up = lambda refs: rank == 0  # this process's own view of the engines
    actor = Actor(lr=1e-2, micro_batch_tokens=256, compile="on", shared_prefix="off")
    config = msgspec.structs.replace(Config(), actor=actor)
    try:
        _actor.PolicyWorker(rank, world_size, "127.0.0.1", port, model_dir, config, engines_loading=[])
        out[rank] = compiled_graphs()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_see_the_engines_differently_stop_their_warm_up_together(tiny_model_dir):
    """FSDP2's ranks run their passes in lock-step: one that saw the engines up stops, and the others with
    it (a rank that went on alone would wait in its first collective for a rank that never comes)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        ranks = mp.spawn(warm_up_rank, args=(2, free_port(), str(tiny_model_dir), out), nprocs=2, join=False)
        deadline = time.monotonic() + 240
        while not ranks.join(timeout=5):
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                pytest.fail("a rank still warms up after 240 s: the ranks did not stop together")
        assert dict(out) == {0: 0, 1: 0}  # neither built a graph
