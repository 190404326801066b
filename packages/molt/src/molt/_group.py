"""The driver's handle on the FSDP2 policy actor: a `PolicyGroup` of `PolicyWorker` Ray actors, one per rank.

The group starts the ranks (`molt._actor.PolicyWorker` under `ray.remote`), shards each batch's rows over
them by their data-parallel coordinate, fans each call out and gathers the results in row order: the TP
ranks of one DP group get the same rows, and the group reads one result per DP group. Built with
`trainable=False` it is a frozen group (the reference policy of `--algo.kl.coef`, the teacher of on-policy
distillation); the PPO critic's group (`molt._critic`) is a subclass. A refit that fails on some engines
raises `EnginesLost`, naming them; the loop drops those and trains on.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import ray
import torch

from molt._actor import PolicyWorker
from molt._batch import NO_INPUTS, StepInputs, TrainBatch
from molt._packing import Together, plan_micro_batches
from molt._placement import gpu_share, refit_backend
from molt._prefix import prefix_groups
from molt._sharding import replicas
from molt.config import Config
from molt.vllm_server import free_port


class EnginesLost(RuntimeError):
    """A refit failed on some engines. `failed`: url -> what went wrong; `updated`: the engines that
    took the new weights and were resumed."""

    def __init__(self, failed: dict[str, str], updated: list[str]) -> None:
        self.failed, self.updated = failed, updated
        lines = [f"  {url}: {why}" for url, why in failed.items()]
        super().__init__("refit failed on engine(s):\n" + "\n".join(lines) + f"\n  updated: {updated}")


def worker_env(*, on_gpu: bool) -> dict[str, str]:
    """The environment a rank starts with. CPU: one thread per rank; under contention that beat two threads
    (FACTS). CUDA: torch's expandable segments, unless the driver's environment sets the allocator itself:
    the token budget is sized from free memory (`molt._actor`), and with fixed-size segments the packed
    micro-batches' changing shapes fragment it until a step runs out of memory (the agentic loop on one
    H100 did, in step 5, with 7 GiB reserved but unallocated; with expandable segments its peak fell from
    47.9 to 42.5 GiB)."""
    if not on_gpu:
        return {"OMP_NUM_THREADS": "1"}
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "expandable_segments:True"
    return {"PYTORCH_CUDA_ALLOC_CONF": setting}


class PolicyGroup:
    """The driver's handle on `num_ranks` `PolicyWorker` Ray actors (Ray is initialised by the caller).

    Rank 0 is pinned to the driver's node, which hosts the process-group rendezvous and, during a refit,
    the weight-transfer rendezvous the engines join. `trainable=False`: a frozen group (reference, teacher).
    `wait=False` returns once the ranks are placed; `ready_refs` are then ready once they have loaded.
    `log_prefix`: rank r writes its output into `{log_prefix}-{r}.log` (empty: Ray's worker logs).
    `engines_loading`: the run's engines' refs, ready once each answers; the ranks' compile warm-up stops
    once they are (`PolicyWorker._warm_up`), and goes on while the first groups come (`warm_up_more`).
    """

    worker_class: type = PolicyWorker

    def __init__(
        self,
        model_dir: str | Path,
        config: Config,
        num_ranks: int,
        *,
        trainable: bool = True,
        wait: bool = True,
        log_prefix: str = "",
        engines_loading: list | None = None,
    ) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.on_gpu = torch.cuda.is_available()
        self.backend = refit_backend(config, on_gpu=self.on_gpu)  # how its refits reach the engines
        self.num_ranks = num_ranks
        self.replicas = replicas(config)  # rank r holds data-parallel shard r // replicas
        self.layout: tuple[int, bool, bool] | None = None  # the ranks' micro-batch layout (`_plan`)
        self.master_addr = ray.util.get_node_ip_address()
        port = free_port(self.master_addr)
        # The driver's own interpreter: under `uv run`, Ray's uv hook would start workers with `uv run` in
        # a copy of the working directory, which has no virtual environment.
        env: dict[str, Any] = {"py_executable": sys.executable, "env_vars": worker_env(on_gpu=self.on_gpu)}
        # No task events: Ray's GCS keeps one for every call (its dashboard's task table), a few a step.
        gpus = gpu_share(config) if self.on_gpu else 0  # a whole GPU, or its part of a shared one
        remote = ray.remote(num_cpus=0, num_gpus=gpus, runtime_env=env, enable_task_events=False)(
            self.worker_class
        )
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        logs = [f"{log_prefix}-{rank}.log" if log_prefix else "" for rank in range(num_ranks)]
        shared = (self.master_addr, port, str(model_dir), config, trainable)
        self.workers = [  # `engines_loading` is a list: Ray passes the refs themselves, not their values
            remote.options(scheduling_strategy=here if rank == 0 else "DEFAULT").remote(
                rank, num_ranks, *shared, logs[rank], engines_loading
            )
            for rank in range(num_ranks)
        ]
        if wait:  # until every rank has loaded its shard; raises if one failed to start
            ray.get(self.ready_refs())

    def ready_refs(self) -> list:
        """One Ray object ref per rank, ready once that rank has loaded its shard."""
        return [w.__ray_ready__.remote() for w in self.workers]

    def _each(self, method: str, *args, shards: list[tuple] | None = None) -> list:
        """Call `method` on every worker, with `args` or each with its own arguments (`shards`, one tuple per
        rank), and wait for all."""
        calls = zip(self.workers, shards or [args] * self.num_ranks, strict=True)
        return ray.get([getattr(worker, method).remote(*arguments) for worker, arguments in calls])

    def _plan(self, batch: TrainBatch) -> list[list[list[int]]]:
        """Each data-parallel rank's micro-batches of `batch`'s rows (`molt._packing`), by the ranks'
        budget (the smallest, should their free memory differ) and whether the model packs; where they
        share prefixes (--actor.shared_prefix), the rows that share one (`molt._prefix`) kept in one
        micro-batch."""
        if self.layout is None:  # asked once the ranks are up; each rank's (budget, packs, shares)
            layouts = self._each("micro_batch_layout")
            self.layout = min(budget for budget, _, _ in layouts), *layouts[0][1:]
        budget, packed, shared_prefix = self.layout
        together: Together = ()
        if shared_prefix:
            groups = prefix_groups(batch.tokens_BT, batch.row_lengths)
            together = [(rows, shared) for rows, shared in groups if shared]
        num_ranks = self.num_ranks // self.replicas  # the data-parallel ranks
        return plan_micro_batches(
            batch.row_lengths, num_ranks=num_ranks, budget=budget, packed=packed, together=together
        )

    def _row_shards(self, batch: TrainBatch, inputs: StepInputs | None = None) -> tuple[list, list[tuple]]:
        """Each data-parallel rank's rows (`_plan`), and each rank's arguments: those rows of `batch`,
        with their micro-batches, and of `inputs` where given. The ranks of one data-parallel coordinate
        get the same rows (module docstring)."""
        ranks_rows, shards = [], []
        for micro_batches in self._plan(batch):
            rows = [row for mb in micro_batches for row in mb]
            local = iter(range(len(rows)))
            plan = tuple(tuple(next(local) for _ in mb) for mb in micro_batches)
            shard = dataclasses.replace(batch.select(rows), plan=plan)
            ranks_rows.append(rows)
            shards.append(
                (shard,) if inputs is None else (shard, inputs.rows(rows, shard.tokens_BT.shape[1]))
            )
        return ranks_rows, [shards[rank // self.replicas] for rank in range(self.num_ranks)]

    def _rows(self, method: str, batch: TrainBatch, *args) -> torch.Tensor:
        """`method`'s [B, T] result for every row of `batch` (each rank's called with its rows, then
        `args`), gathered in row order."""
        ranks_rows, shards = self._row_shards(batch)
        results = self._each(method, shards=[(*shard, *args) for shard in shards])[:: self.replicas]
        out_BT = torch.zeros(batch.tokens_BT.shape)
        for rows, result_BT in zip(ranks_rows, results, strict=True):
            if rows:
                out_BT[rows, : result_BT.shape[1]] = result_BT
        return out_BT

    def startup_seconds(self) -> dict[str, float]:
        """Each start-up part of the ranks (`ModelRank.startup_seconds`), the slowest rank's."""
        ranks = self._each("startup_seconds")
        return {part: max(rank[part] for rank in ranks) for part in ranks[0]}

    def warm_up_more(self) -> int:
        """One more pass of the ranks' compile warm-up, every rank the same one (FSDP2's collectives run
        in lock-step); the passes left (`PolicyWorker.warm_up_more`)."""
        return self._each("warm_up_more")[0]

    def pass_metrics(self) -> dict[str, float]:
        """`actor/padding_frac` (token slots that held padding), `actor/shared_prefix_frac` (the rows'
        tokens that shared prefixes saved a slot for), `actor/tokens_per_s` and, on a GPU of known peak
        computing in bfloat16, `actor/mfu` (model FLOPs over peak FLOPs), over the passes this group ran
        since the last call; the TP ranks of a data-parallel group count once. `actor/compiles`: the
        graphs torch.compile built meanwhile (0 once every shape has been seen)."""
        counts = self._each("take_pass_counts")[:: self.replicas]
        slots, tokens = sum(c["slots"] for c in counts), sum(c["tokens"] for c in counts)
        saved, seconds = sum(c["saved"] for c in counts), max(c["seconds"] for c in counts)
        if not slots or not seconds:
            return {}
        metrics = {
            "actor/padding_frac": 1 - (tokens - saved) / slots,
            "actor/shared_prefix_frac": saved / tokens,
            "actor/tokens_per_s": tokens / seconds,
            "actor/compiles": max(c["compiles"] for c in counts),
        }
        if counts[0]["peak_flops"]:
            flops = sum(c["flops"] for c in counts)
            metrics["actor/mfu"] = flops / (seconds * counts[0]["peak_flops"] * len(counts))
        return metrics

    def logprobs(self, batch: TrainBatch, *, trained_only: bool = False) -> torch.Tensor:
        """Logprobs of every row of `batch`, [B, T], in row order; with `trained_only`, of its trained
        tokens alone, 0 elsewhere (`PolicyWorker.logprobs`)."""
        return self._rows("logprobs", batch, trained_only)

    def train_step(self, batch: TrainBatch, inputs: StepInputs = NO_INPUTS) -> dict[str, float]:
        """One optimizer step over the whole batch; returns the global metrics (`PolicyWorker.train_step`
        says which inputs it reads)."""
        batch.check_step(inputs)
        # every rank reports the same all-reduced metrics
        return self._each("train_step", shards=self._row_shards(batch, inputs)[1])[0]

    def refit(self, engine_urls: list[str], version: int) -> dict:
        """Refit the engines with the current weights as `version`; returns rank 0's phase seconds.
        Raises `EnginesLost` when some engines failed (the others were updated and resumed). The engines
        reach rank 0 at the driver node's address."""
        report = self._each("refit", list(engine_urls), self.backend, version, self.master_addr)[0]
        if failed := report.pop("failed"):
            raise EnginesLost(failed, updated=[url for url in engine_urls if url not in failed])
        return report

    def save(self, path: str | Path) -> None:
        """Checkpoint the model, optimizer and schedule into `path` (each rank writes its shards)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self._each("save", str(path))

    def load(self, path: str | Path) -> None:
        """Restore the model, optimizer and schedule from a checkpoint written by `save`."""
        self._each("load", str(path))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full parameters gathered from the shards."""
        return self._each("full_state")[0]

    def shutdown(self) -> None:
        """Kill the workers (their process group and engine connections go with them)."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
