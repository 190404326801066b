"""One rollout: run an agent on one dataset row and return its token-exact trajectory with a reward.

An `Env` episode calls tito in process with prompt token ids (the template rendered here, once, with
the same continuation rule as tito's chat routes), so its tokens are captured exactly as a chat agent's
would be. The trajectory is tito's capture; the reward is the agent's. A rollout that raises, times
out or returns a non-finite reward raises here: the pool retries it, then drops its group and counts it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field

from molt.agent import ChatAgent, Result
from molt.config import Config
from tito import ChatRenderer, Segment, Tito

__all__ = ["Rollout", "RolloutRunner"]


@dataclass
class Rollout:
    """A finished episode. `sampled` is every token id the engine returned, in order, straight from the
    engine's replies: the trainer checks the trajectory's trainable tokens against it (token identity)."""

    segments: list[Segment]
    reward: float
    sampled: list[int]
    truncated: bool
    info: dict[str, float] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        return min(v for s in self.segments for v, m in zip(s.versions, s.loss_mask, strict=True) if m)

    @property
    def max_version(self) -> int:
        return max(v for s in self.segments for v, m in zip(s.versions, s.loss_mask, strict=True) if m)


def _as_messages(observation) -> list[dict]:
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)


class RolloutRunner:
    """The pool's rollout callable: `await runner(row, index) -> Rollout`."""

    def __init__(self, tito: Tito, agent_module, config: Config, runners: list) -> None:
        if issubclass(agent_module.AgentRunner, ChatAgent):
            raise ValueError(
                f"--agent.module {config.agent.module}: ChatAgent runners are not served by the training "
                "loop yet; write the agent as a molt.Env"
            )
        self.tito = tito
        self.config = config
        self.runners = itertools.cycle(runners)  # Ray actors hosting the Env episodes (molt._runners)
        self.renderer = ChatRenderer(tito.tokenizer)
        self.sampling = {
            "max_tokens": config.rollout.max_new_tokens,
            "temperature": config.rollout.temperature,
            "top_p": config.rollout.top_p,
        }

    async def __call__(self, row: dict, index: int) -> Rollout:
        async with asyncio.timeout(self.config.agent.timeout):
            rollout = await self._env_episode(next(self.runners), row)
        if not math.isfinite(rollout.reward):
            raise ValueError(f"the agent returned a non-finite reward ({rollout.reward})")
        if not rollout.sampled:
            raise ValueError("the rollout sampled no token")
        return rollout

    async def _env_episode(self, runner, row: dict) -> Rollout:
        session = self.tito.new_session()
        tokenizer = self.tito.tokenizer
        reward, sampled, info, truncated = 0.0, [], {}, False
        try:
            observation = await runner.reset.remote(session.id, row)
            messages: list[dict] = []
            for _ in range(self.config.agent.max_turns):
                messages += _as_messages(observation)
                prompt_ids = self._prompt_ids(session, messages, observation)
                generation = await self.tito.generate(session, prompt_ids, **self.sampling)
                sampled += generation.token_ids
                truncated = generation.finish_reason == "length"
                reply = {
                    "role": "assistant",
                    "content": tokenizer.decode(generation.token_ids, skip_special_tokens=True),
                }
                closing = self.renderer.closing_ids(generation.token_ids)
                session.chat.record(messages, None, prompt_ids, reply, closing)
                messages.append(reply)
                result: Result = await runner.step.remote(session.id, reply["content"])
                reward += result.reward
                info.update(result.info)
                observation = result.observation
                if observation is None:
                    break
        finally:
            trajectory = self.tito.end_session(session.id)
            runner.close.remote(session.id)
        return Rollout(trajectory.segments, reward, sampled, truncated, info)

    def _prompt_ids(self, session, messages: list[dict], observation) -> list[int]:
        """The chat template is applied exactly once: here by default, or already in the data
        (`--data.apply_chat_template false`: the observation is rendered text, tokenized as it is)."""
        if self.config.data.apply_chat_template:
            return session.chat.prompt_ids(self.renderer, session.capture.tokens, messages, None)
        if not isinstance(observation, str):
            raise ValueError("with --data.apply_chat_template false an Env observation must be rendered text")
        closing = session.chat.closing if session.capture.tokens else []
        return session.capture.tokens + closing + self.renderer.encode(observation)
