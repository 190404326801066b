"""The checks of `molt._validate.validate` that read what the config names outside itself: the files and
directories the run reads and writes, the addresses it joins (vLLM servers, a Ray head, a W&B project),
and the agent module against the data settings. Every message names the flag and what to do.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from molt.config import Config, ConfigError

__all__ = ["check_agent", "check_paths"]


def check_paths(config: Config) -> None:
    """Files the run reads exist; directories it writes are not files; engine URLs are URLs."""
    for flag, path in (("--data.path", config.data.path), ("--eval.path", config.eval.path)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file (a JSONL file of rows)")
    models = {
        "--model.path": config.model.path,
        "--algo.teacher.model": config.algo.teacher.model,
        "--algo.critic.model": config.algo.critic.model,
    }
    for flag, path in models.items():
        if path and not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{flag} {path} is not a Hugging Face model directory (no config.json)")
    for flag, path in (
        ("--logger.run_dir", config.logger.run_dir),
        ("--ckpt.dir", config.ckpt.dir),
        ("--train.rollout_dump_dir", config.train.rollout_dump_dir),
    ):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{flag} {path} is a file; it names a directory the run writes into")
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
    if not config.data.path and not hasattr(module, "dataset"):
        raise ConfigError(f"--agent.module {config.agent.module} has no dataset(seed); pass --data.path")
