"""A verifiers taskset whose reward fails: it raises on one task and gives NaN on the other."""

import math

import verifiers.v1 as vf


class BrokenData(vf.TaskData):
    fault: str


class BrokenTask(vf.Task[BrokenData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def judged(self, trace) -> float:
        if self.data.fault == "raises":
            raise RuntimeError("the scorer broke")
        return math.nan


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        for fault in ("raises", "nan"):
            yield BrokenTask(BrokenData(prompt="say anything", fault=fault), self.config.task)


__all__ = ["BrokenTaskset"]
