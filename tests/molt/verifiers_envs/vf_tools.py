"""A verifiers taskset with an MCP toolset: an adder the model may call."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    total: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [AddToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, trace) -> float:
        return float(str(self.data.total) in trace.last_reply)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in ((2, 3), (4, 5)):
            yield SumTask(
                SumData(prompt=f"What is {a} + {b}? Use the add tool.", total=a + b), self.config.task
            )


__all__ = ["SumTaskset"]

if __name__ == "__main__":  # verifiers starts a tool server as `python -m MODULE`
    AddToolset.run()
