"""A single-turn verifiers taskset, written as verifiers' own users write one: say a word."""

import verifiers.v1 as vf

WORDS = ("fox", "cat", "dog", "owl")


class SayData(vf.TaskData):
    word: str


class SayTask(vf.Task[SayData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def said(self, trace) -> float:
        return float(trace.last_reply.startswith(self.data.word))

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class SayTaskset(vf.Taskset[SayTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield SayTask(SayData(prompt=f"copy the word: {word}", word=word), self.config.task)


__all__ = ["SayTaskset"]
