"""A multi-turn verifiers environment: the environment answers each reply until the word is said or three
turns have passed."""

import verifiers.v1 as vf

WORDS = ("fox", "cat")


class GuessData(vf.TaskData):
    word: str


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield GuessTask(GuessData(prompt=f"copy the word: {word}", word=word), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        turns, said = 0, False
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                turns += 1
                said = segment.last_reply.startswith(task.data.word)
                if said or turns == 3:
                    break
                segment = await interaction.turn(f"Not quite. Say {task.data.word}.")
        interaction.trace.record_reward("said", float(said), 1.0)
        interaction.trace.record_metric("turns", float(turns))


__all__ = ["GuessEnv", "GuessTaskset"]
