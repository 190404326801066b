"""molt: asynchronous agentic RL. Agents are plain Python: subclass `Env` or `ChatAgent`, return a `Result`.

Importing molt loads no torch, Ray or vLLM (the `molt` command starts instantly); `molt.train(config)`,
a run from Python, imports them when it starts.
"""

from molt._dumps import RolloutRecord, read_rollouts
from molt.agent import ChatAgent, Context, Env, Result
from molt.config import Config

__all__ = ["ChatAgent", "Context", "Env", "Result", "RolloutRecord", "read_rollouts", "train"]


def train(config: Config, *, resume: bool = False) -> None:
    """Train as `molt train` does with `config` (`molt.config.Config`): every refusal before anything
    starts, then the run. `resume`: continue from the newest checkpoint under `--ckpt.dir`."""
    from molt._launch import train as launch_run  # torch, Ray and vLLM load from here on

    launch_run(config, resume=resume)
