"""molt: asynchronous agentic RL. Agents are plain Python: subclass `Env` or `ChatAgent`, return a `Result`.

Importing molt loads no torch, Ray or vLLM (the `molt` command starts instantly); a run's launch,
`molt._launch.train`, imports them when a run starts.
"""

from molt._dumps import RolloutRecord, read_rollouts
from molt.agent import ChatAgent, Context, Env, Result

__all__ = ["ChatAgent", "Context", "Env", "Result", "RolloutRecord", "read_rollouts"]
