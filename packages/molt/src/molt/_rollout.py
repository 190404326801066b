"""One rollout: run an agent on one dataset row and return its token-exact trajectory with a reward.

An `Env` episode calls tito in process with prompt token ids (the template rendered here, once, with
the same renderer and continuation rule as tito's chat routes); a `ChatAgent` episode gets a tito
session's URLs and talks to it over HTTP with its own SDK. Either way the trajectory is tito's capture
(several segments if the agent compacted its context) and the reward is the agent's: one rollout, one
reward. A rollout that raises, times out or returns a non-finite reward raises here, counted by kind in
`failures`: the pool retries it (a lost rollout, not a lost run), then drops its group and counts it.
While no engine serves and one is being restarted (`molt._restarts`), a failed rollout first waits for it.

Images (a vision-language policy): observations and chat messages may hold OpenAI `image_url` parts;
tito expands them and the trajectory's segments carry them on their placeholder tokens. A rollout in
which the policy itself sampled an image placeholder token is refused (raised, so retried): the
trainer's model reads every placeholder token as part of an image, so it could not be trained as
sampled.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

from molt._restarts import EngineRestarts
from molt.agent import Context, Result
from molt.config import Config
from tito import ContextFull, EngineUnavailable, Prompt, Segment, Tito

# `molt._metrics.rollout_metrics`' own names under rollout/, which an agent's info keys may not take
BUILT_IN = ("reward_mean", "reward_std_in_group", "response_len_mean", "truncated_frac", "segments_mean")


@dataclass
class Rollout:
    """A finished episode. `sampled` is every token id the engine returned, in order, recorded from the
    engine's replies apart from the segments (an Env's episode keeps them; for a ChatAgent, tito's reply
    log): the trainer checks the trajectory's trainable tokens against it (`loop.check_token_identity`)."""

    segments: list[Segment]
    reward: float
    sampled: list[int]
    truncated: bool
    info: dict[str, float] = field(default_factory=dict)

    @property
    def trained_versions(self) -> list[int]:
        """The weight version that sampled each trained token, segment by segment."""
        return [v for s in self.segments for v, m in zip(s.versions, s.loss_mask, strict=True) if m]

    @property
    def min_version(self) -> int:
        return min(self.trained_versions)

    @property
    def max_version(self) -> int:
        return max(self.trained_versions)


def sampling(config: Config) -> dict[str, Any]:
    """How every turn samples (`--rollout.*`): as the trainer assumes, whatever an agent asks. tito fixes
    it (`Tito(fixed_sampling=...)`) for an Env's turns and a ChatAgent's alike."""
    rollout = config.rollout
    return {"max_tokens": rollout.max_new_tokens, "temperature": rollout.temperature, "top_p": rollout.top_p}


def _as_messages(observation) -> list[dict]:
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)


class RolloutRunner:
    """The pool's rollout callable: `await runner(row, index) -> Rollout`.

    `tito`: the run's, which fixes every turn's sampling (`sampling`). `hosts`: where the agents run
    (`molt._runners`). `chat_url`, `api_key`: tito's HTTP address for ChatAgent episodes (tito served on
    this event loop); not needed for an Env.
    """

    def __init__(
        self,
        tito: Tito,
        config: Config,
        hosts: list,
        *,
        chat_url: str = "",
        api_key: str = "",
        restarts: EngineRestarts | None = None,
    ) -> None:
        # restarts: the engines molt restarts, which a failed rollout waits for
        self.tito, self.config, self.restarts = tito, config, restarts
        self.hosts = itertools.cycle(hosts)
        self.chat_url, self.api_key = chat_url, api_key
        # logged as agent/<kind>; engine_unavailable: rollouts lost because their engine stopped answering
        self.failures = {"raised": 0, "timed_out": 0, "nonfinite_reward": 0, "engine_unavailable": 0}

    async def __call__(self, row: dict, index: int) -> Rollout:
        episode = self._chat_episode if self.chat_url else self._env_episode
        try:
            async with asyncio.timeout(self.config.agent.timeout):
                rollout = await episode(next(self.hosts), row, index)
            if (images := self.tito.renderer.images) is not None and images.image_token_id in rollout.sampled:
                raise ValueError(
                    "the policy sampled an image placeholder token; the trainer's model would read it as "
                    "part of an image, so this rollout cannot be trained as sampled (it is retried)"
                )
            if bad := {k: v for k, v in rollout.info.items() if not isinstance(v, SupportsFloat)}:
                raise ValueError(f"Result.info maps names to numbers (logged as rollout/<name>), not {bad}")
            if taken := sorted(rollout.info.keys() & set(BUILT_IN)):
                raise ValueError(f"Result.info keys {taken} are molt's own rollout/ metrics: rename them")
            # Plain floats (as the reward): the trainer's metrics and rollout dumps take no numpy scalars.
            rollout.info = {key: float(value) for key, value in rollout.info.items()}
        except TimeoutError:
            self.failures["timed_out"] += 1
            raise TimeoutError(f"the agent ran past --agent.timeout {self.config.agent.timeout} s") from None
        except Exception as error:  # a ChatAgent's SDK reports a dead engine as its own error ("raised")
            self.failures["engine_unavailable" if isinstance(error, EngineUnavailable) else "raised"] += 1
            # When no engine serves but one is being restarted, wait for it: the pool's retry of this
            # rollout then runs on it instead of failing at once (its group would be lost).
            if self.restarts is not None:
                await self.restarts.serving()
            raise
        if not math.isfinite(rollout.reward):
            self.failures["nonfinite_reward"] += 1
            raise ValueError(f"the agent returned a non-finite reward ({rollout.reward})")
        if not rollout.sampled:
            raise ValueError("the rollout sampled no token: the agent made no request to the model")
        return rollout

    async def _chat_episode(self, host, row: dict, index: int) -> Rollout:
        """A ChatAgent episode: the agent's SDK talks to this session's URLs; tito captures every turn."""
        session = self.tito.new_session()
        url = f"{self.chat_url}/s/{session.id}"
        ctx = Context(base_url=f"{url}/v1", session_url=url, model=self.tito.model_name, api_key=self.api_key)
        try:
            result: Result = await host.run(ctx, row)
        finally:
            trajectory = self.tito.end_session(session.id)
        # tito's reply log, read with no await since the trajectory was taken: no turn came between
        sampled = [token for reply in session.capture.replies for token in reply]
        truncated = session.finish_reason == "length"
        # Tool calls the model wrote that did not parse: rollout/tool_parse_failed, never silently lost.
        if "tool_parse_failed" in result.info:
            raise ValueError("Result.info key 'tool_parse_failed' is molt's own rollout/ metric: rename it")
        info = {"tool_parse_failed": trajectory.tool_parse_failures, **result.info}
        return Rollout(trajectory.segments, float(result.reward), sampled, truncated, info)

    def _seed(self, row: dict, index: int, turn: int) -> int | None:
        """--rollout.seed_requests: a seed from the row's content, the sample index and the turn."""
        if not self.config.rollout.seed_requests:
            return None
        key = json.dumps([self.config.train.seed, row, index, turn], sort_keys=True, default=str)
        return zlib.crc32(key.encode())

    async def _env_episode(self, host, row: dict, index: int) -> Rollout:
        session = self.tito.new_session()
        tools = row.get("tools")  # OpenAI function schemas, rendered into the prompt by the template
        reward, sampled, info, messages, ended, full = 0.0, [], {}, [], False, False
        try:
            observation = await host.reset(session.id, row)
            for turn in range(self.config.agent.max_turns):
                messages += _as_messages(observation)
                prompt = self._prompt(session, messages, tools, observation)
                try:
                    generation = await self.tito.generate(
                        session, prompt.token_ids, images=prompt.images, seed=self._seed(row, index, turn)
                    )
                except ContextFull:  # the episode outgrew the context: it ends truncated, as it stands
                    if turn == 0:
                        raise  # the first prompt alone: nothing sampled to train
                    full = True
                    break
                sampled += generation.token_ids
                text = self.tito.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
                reply = {"role": "assistant", "content": text}
                closing = self.tito.renderer.closing_ids(generation.token_ids)
                session.chat.record(messages, tools, prompt, reply, closing)
                messages.append(reply)
                result: Result = await host.step(session.id, text)
                reward += float(result.reward)
                info.update(result.info)
                observation = result.observation
                if ended := observation is None:
                    break
        finally:
            trajectory = self.tito.end_session(session.id)
            if not ended:  # the host forgets an ended episode itself (`AgentHost.step`)
                await host.close(session.id)
        # truncated: the context is full, or the last turn was cut at the token limit, as for a ChatAgent
        return Rollout(trajectory.segments, reward, sampled, full or session.finish_reason == "length", info)

    def _prompt(self, session, messages: list[dict], tools, observation) -> Prompt:
        """The chat template is applied exactly once: here by default, or already in the data
        (`--data.apply_chat_template false`: the observation is rendered text, tokenized as it is)."""
        capture = session.capture
        if self.config.data.apply_chat_template:
            return session.chat.prompt(self.tito.renderer, capture.tokens, messages, tools, capture.images)
        if not isinstance(observation, str):
            raise ValueError("with --data.apply_chat_template false an Env observation must be rendered text")
        closing = session.chat.closing if capture.tokens else []
        return Prompt(capture.tokens + closing + self.tito.renderer.encode(observation), list(capture.images))
