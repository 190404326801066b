"""The checks of `molt._validate.validate` that do not read the model: the combinations of flags (numbers
tied to one another; asynchrony without importance correction, DESIGN invariant 2; a group baseline over
groups of one; a sampler the trainer does not reproduce, invariant 3) and the derived values they fill;
and what the config names outside itself: the files and directories the run reads and writes, the
addresses it joins (vLLM servers, a Ray head, a W&B project), and the agent module against the data
settings. Each numeric field's own bound is `molt._bounds`'; the model `molt._checks_model`'s; what this
machine can run is `molt._validate`'s; the order of the pass is `validate`'s. Every message names the
flags and what to do.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import get_args

import msgspec

from molt._bounds import field_value
from molt._config_algo import estimator_needs, loss_agg
from molt.config import Config, ConfigError, OutcomeEstimator


def _changed(config: Config, *flags: str) -> list[str]:
    """Those of the dotted `flags` whose value differs from the default: the ones the run was given."""
    return [flag for flag in flags if field_value(config, flag) != field_value(Config(), flag)]


def check_pairs(config: Config) -> None:
    """The bounds that tie one numeric field to another (each one's own: `molt._bounds`)."""
    for flag in ("token_bounds", "seq_bounds"):
        low, high = getattr(config.algo.correction, flag)
        if not low < high:
            raise ConfigError(f"--algo.correction.{flag} is (low, high) with low < high, got ({low}, {high})")
        if not low <= 1 <= high:  # 1: the ratio where the engine and the trainer agree, as on-policy
            raise ConfigError(
                f"--algo.correction.{flag} ({low}, {high}) leaves out 1, the ratio of a token the engine and "
                "the trainer score alike: every on-policy token would weigh 0; pick low <= 1 <= high"
            )
    if config.eval.k > config.eval.n:
        raise ConfigError(f"--eval.k {config.eval.k} must lie in 1..--eval.n ({config.eval.n})")
    if 0 < config.vllm.kv_cache_tokens < config.vllm.max_model_len:
        raise ConfigError(
            f"--vllm.kv_cache_tokens {config.vllm.kv_cache_tokens} cannot hold one sequence of "
            f"--vllm.max_model_len {config.vllm.max_model_len}: raise it (or 0, sized from the run)"
        )
    if config.rollout.max_new_tokens >= config.vllm.max_model_len:
        raise ConfigError(
            f"--rollout.max_new_tokens {config.rollout.max_new_tokens} leaves no room for a prompt in "
            f"--vllm.max_model_len {config.vllm.max_model_len}: raise the one or lower the other"
        )


def groups_in_flight(config: Config) -> int:
    """--rollout.queue_depth as a run keeps it: one step of groups with --train.force_on_policy, else the
    flag, or with 0 two steps (`on_policy` fills it in; this reads it from an unvalidated config too)."""
    rollout = config.rollout
    if config.train.force_on_policy:
        return rollout.prompts_per_step
    return rollout.queue_depth or 2 * rollout.prompts_per_step


def on_policy(config: Config) -> Config:
    """Apply --train.force_on_policy and fill --rollout.queue_depth 0 (derived values)."""
    rollout = config.rollout
    if config.train.force_on_policy:
        if rollout.queue_depth not in (0, rollout.prompts_per_step):
            raise ConfigError(
                "--train.force_on_policy keeps exactly one step of groups in flight, but "
                f"--rollout.queue_depth is {rollout.queue_depth} (!= --rollout.prompts_per_step "
                f"{rollout.prompts_per_step}): drop --rollout.queue_depth or --train.force_on_policy"
            )
        if rollout.max_lag > 1:  # 1: the default, which it replaces
            raise ConfigError(
                f"--train.force_on_policy trains each group on the weights that sampled it (max lag 0), but "
                f"--rollout.max_lag is {rollout.max_lag}: drop --rollout.max_lag or --train.force_on_policy"
            )
        rollout = msgspec.structs.replace(rollout, max_lag=0, partial_rollout=False)
    rollout = msgspec.structs.replace(rollout, queue_depth=groups_in_flight(config))
    if rollout.queue_depth < rollout.prompts_per_step:
        raise ConfigError(
            f"--rollout.queue_depth {rollout.queue_depth} is below --rollout.prompts_per_step "
            f"{rollout.prompts_per_step}: a step could never fill; raise it, or pass 0 (2 x prompts_per_step)"
        )
    return msgspec.structs.replace(config, rollout=rollout)


def loss_denominator(config: Config) -> Config:
    """Fill --algo.loss.agg auto and --algo.loss.agg_constant 0 (derived values); refuse a constant that
    the aggregation it would go with does not use."""
    loss = config.algo.loss
    agg = loss_agg(config.algo)
    if agg != "seq-mean-token-sum-norm" and loss.agg_constant:
        raise ConfigError(
            f"--algo.loss.agg_constant {loss.agg_constant} divides only under --algo.loss.agg "
            f"seq-mean-token-sum-norm, and this run's is {agg}: pass that, or drop the constant"
        )
    # Dr. GRPO's constant is the generation budget (Liu et al. 2025, §3.2); no other aggregation has one.
    constant = (loss.agg_constant or config.rollout.max_new_tokens) if agg == "seq-mean-token-sum-norm" else 0
    loss = msgspec.structs.replace(loss, agg=agg, agg_constant=constant)
    return msgspec.structs.replace(config, algo=msgspec.structs.replace(config.algo, loss=loss))


def check_algorithm(config: Config) -> None:
    """The algorithm's flags against each other and the sampler's (DESIGN invariants 2 and 3)."""
    rollout, algo = config.rollout, config.algo
    # DESIGN invariant 2: tokens from an older policy, or mixed versions, need the importance correction.
    if (rollout.max_lag >= 1 or rollout.partial_rollout) and algo.correction.mode == "none":
        raise ConfigError(
            "--algo.correction.mode none needs on-policy rollouts, but "
            f"--rollout.max_lag is {rollout.max_lag} and --rollout.partial_rollout is "
            f"{str(rollout.partial_rollout).lower()}: pick a correction mode (tis, mis, seq-mask-tis) "
            "or pass --train.force_on_policy"
        )
    # The bounds each mode reads in `rlestimators.rollout_correction` (none reads none); the rest do nothing.
    mode = algo.correction.mode
    reads = {"tis": ("token_cap",), "mis": ("token_bounds",), "seq-mask-tis": ("token_cap", "seq_bounds")}
    unread = [name for name in ("token_cap", "token_bounds", "seq_bounds") if name not in reads.get(mode, ())]
    if unused := _changed(config, *(f"algo.correction.{name}" for name in unread)):
        raise ConfigError(
            f"--{unused[0]} {field_value(config, unused[0])} is set, but --algo.correction.mode {mode} does "
            "not read it (tis reads token_cap, mis token_bounds, seq-mask-tis token_cap and seq_bounds): "
            "drop it, or pick a mode that reads it"
        )
    # --rollout.stale keep needs no check against the correction: a group can go stale only with max_lag
    # >= 1 (the pool admits no more than one step of groups at max_lag 0), which already needs it. And
    # asyncpool.GroupPool reads max_requeues only when it drops a stale group, which keep never does.
    if rollout.stale == "keep" and _changed(config, "rollout.max_stale_requeues"):
        raise ConfigError(
            f"--rollout.max_stale_requeues {rollout.max_stale_requeues} caps the reruns of a prompt whose "
            "groups were dropped as stale, and --rollout.stale keep drops none: pass --rollout.stale drop, "
            "or drop it"
        )
    if rollout.group_size == 1 and algo.advantage.estimator in get_args(OutcomeEstimator):
        raise ConfigError(
            f"--algo.advantage.estimator {algo.advantage.estimator} baselines each sample against its group, "
            "so --rollout.group_size 1 gives every advantage 0: raise --rollout.group_size"
        )
    if not algo.kl.coef and (kl_set := _changed(config, "algo.kl.kind", "algo.kl.in_reward")):
        raise ConfigError(
            f"--{kl_set[0]} is set, but --algo.kl.coef is 0 (no KL penalty, no reference model): "
            "pass a coefficient, or drop it"
        )
    if algo.kl.coef and not algo.kl.in_reward and algo.kl.kind == "k1":
        raise ConfigError(
            "--algo.kl.kind k1 as a loss term has zero expected gradient (its derivative on a sampled token "
            "is grad log pi, whose mean over pi's samples is 0): the penalty would do nothing while train/kl "
            "shows a value. Pass --algo.kl.kind k2 (the gradient of KL(pi || ref)) or k3 (GRPO's: that of "
            "KL(ref || pi)), or keep k1 in the reward with --algo.kl.in_reward true"
        )
    loss = algo.loss
    if loss.dual_clip is not None and loss.kind not in ("ppo", "gspo"):  # rlestimators.policy_loss refuses it
        raise ConfigError(
            f"--algo.loss.dual_clip {loss.dual_clip} bounds the clipped surrogate of ppo and gspo, which "
            f"--algo.loss.kind {loss.kind} does not have: drop it, or pick ppo or gspo"
        )
    if loss.kind == "pg" and (clips := _changed(config, "algo.loss.clip_low", "algo.loss.clip_high")):
        raise ConfigError(
            f"--{clips[0]} is set, but --algo.loss.kind pg clips nothing: drop it, or pick ppo, gspo or cispo"
        )
    if not algo.filters and _changed(config, "algo.filter_max_batches"):
        raise ConfigError(
            "--algo.filter_max_batches bounds the groups --algo.filters drop, and none is on: name a filter "
            "(--algo.filters all_equal_rewards), or drop it"
        )
    if rollout.group_size == 1 and "all_equal_rewards" in algo.filters:  # one reward is always all equal
        raise ConfigError(
            "--algo.filters all_equal_rewards drops every group of --rollout.group_size 1, so no step would "
            "fill: raise --rollout.group_size, or take the filter out"
        )
    if twice := next((name for name in algo.filters if algo.filters.count(name) > 1), None):
        raise ConfigError(f"--algo.filters names {twice} twice: name each filter once")
    needs, estimator = estimator_needs(algo.advantage.estimator), algo.advantage.estimator
    if needs.teacher and not algo.teacher.model:
        raise ConfigError(
            f"--algo.advantage.estimator {estimator} distils from a teacher: set --algo.teacher.model DIR"
        )
    if not needs.rewards and algo.kl.coef and algo.kl.in_reward:
        raise ConfigError(
            f"--algo.kl.in_reward changes the reward, which --algo.advantage.estimator {estimator} does not "
            "use: drop --algo.kl.in_reward (the KL then is a loss term)"
        )
    read = {"gae": needs.critic, "critic": needs.critic, "teacher": needs.teacher}
    if unused := _changed(config, *(f"algo.{name}" for name, on in read.items() if not on)):
        raise ConfigError(
            f"--{unused[0]}.* is set, but --algo.advantage.estimator {estimator} does not use it (gae "
            "reads --algo.gae and --algo.critic, opd --algo.teacher): drop it, or pick that estimator"
        )
    rollouts = rollout.prompts_per_step * rollout.group_size
    if config.train.mini_batches > rollouts:
        raise ConfigError(
            f"--train.mini_batches {config.train.mini_batches} is more than the step's {rollouts} rollouts "
            f"(--rollout.prompts_per_step x --rollout.group_size): each optimizer step needs one"
        )
    # DESIGN invariant 3: the trainer computes the full softmax at the sampling temperature.
    if config.rollout.top_p < 1:
        raise ConfigError(
            f"--rollout.top_p {config.rollout.top_p}: the engine would renormalise each logprob over the "
            "nucleus, which the trainer's full softmax does not reproduce, so every ratio and correction "
            "weight would be off; sample with --rollout.top_p 1 (shape the distribution with "
            "--rollout.temperature)"
        )


def check_paths(config: Config) -> None:
    """Files the run reads exist; directories it writes are not files; engine URLs are URLs."""
    for flag in ("data.path", "eval.path"):
        if (path := field_value(config, flag)) and not Path(path).is_file():
            raise ConfigError(f"--{flag} {path}: no such file (a JSONL file of rows)")
    for flag in ("model.path", "algo.teacher.model", "algo.critic.model"):
        if (path := field_value(config, flag)) and not (Path(path) / "config.json").is_file():
            raise ConfigError(f"--{flag} {path} is not a Hugging Face model directory (no config.json)")
    for flag in ("logger.run_dir", "ckpt.dir", "train.rollout_dump_dir"):
        if (path := field_value(config, flag)) and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"--{flag} {path} is a file; it names a directory the run writes into")
    for url in config.vllm.urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--vllm.urls {url!r}: each is a running vLLM server's http:// address")
    project = config.logger.wandb_project
    if project and (len(project) > 128 or any(c in project for c in "/\\#?%:")):  # W&B's own rule
        raise ConfigError(
            f"--logger.wandb_project {project!r}: a W&B project name has at most 128 characters and none of "
            "/ \\ # ? % :"
        )
    if config.logger.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"--logger.wandb_project {config.logger.wandb_project} needs the wandb package, which is not "
            "installed: run `uv sync --extra wandb` (or `pip install 'molt[wandb]'`), or drop the flag"
        )
    if not config.data.messages_key:
        raise ConfigError("--data.messages_key is empty: name the rows' field that holds chat messages")
    # `molt._data` reads the key from JSONL rows only; an agent's dataset() rows hold theirs under messages.
    if not config.data.path and not config.eval.path and _changed(config, "data.messages_key"):
        raise ConfigError(
            f"--data.messages_key {config.data.messages_key} names a field of the rows of --data.path or "
            "--eval.path, and neither is set (the agent module's rows are read under messages): pass a file, "
            "or drop it"
        )
    address = config.ray.address
    if address and address != "auto" and not re.fullmatch(r"(ray://)?[\w.\-]+:\d+", address):
        raise ConfigError(f"--ray.address {address!r}: pass a Ray head's HOST:PORT, ray://HOST:PORT or auto")
    if config.ray.address and config.ray.num_cpus is not None:
        raise ConfigError(
            "--ray.num_cpus sizes a local Ray; the cluster at --ray.address has its own CPUs: "
            "drop one of the two"
        )


def check_agent(config: Config) -> None:
    """The agent module exports an AgentRunner that the data settings can serve."""
    from molt.agent import ChatAgent, load_agent

    try:
        module = load_agent(config.agent.module)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if issubclass(module.AgentRunner, ChatAgent) and not config.data.apply_chat_template:
        raise ConfigError(
            f"--agent.module {config.agent.module} is a ChatAgent: it sends chat messages, which tito "
            "renders with the chat template; --data.apply_chat_template false (rows already rendered as "
            "text) serves only Env agents"
        )
    # An Env's turns are molt's loop (`molt._rollout`); a ChatAgent's SDK makes its own turns and requests.
    env_only = _changed(config, "agent.max_turns", "rollout.seed_requests")
    if issubclass(module.AgentRunner, ChatAgent) and env_only:
        raise ConfigError(
            f"--{env_only[0]} acts on an Env's turns, and --agent.module {config.agent.module} is a "
            "ChatAgent, whose own SDK loop makes its turns and requests: drop it (bound the turns, or seed "
            "the requests, in the agent)"
        )
    if not config.data.path and not hasattr(module, "dataset"):
        raise ConfigError(f"--agent.module {config.agent.module} has no dataset(seed); pass --data.path")
