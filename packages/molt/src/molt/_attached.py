"""Engines someone else started (`--vllm.urls`), checked once they hold the run's weights.

`molt._engines.check_attached` can only ask such a server whether it answers. What makes its tokens
trainable shows only once the trainer's weights are in it (the initial refit, `molt._launch`): one short
probe, sampled at the run's temperature, must come back
- labelled with the weight version that refit gave it: an engine without refit's middleware
  (`--middleware refit.vllm_versions.WeightVersions`, one of `refit.engine_flags`) labels every token
  version 0, so staleness, admission and `train/mismatch_kl`'s lag-0 split would all read wrong;
- with the logprobs the trainer computes for the same tokens: an engine without `--logprobs-mode
  processed_logprobs` returns the logprobs before the temperature, so every correction weight is off
  at any temperature other than 1 (at 1 the two coincide, and so does the check).
A mismatch stops the run naming the flags molt gives its own engines (`molt.vllm_server.engine_args`,
`molt._engines.engine_extra_args`). It does not check an engine's other flags.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import torch

from molt._batch import TrainBatch, collate

PROBE_PROMPT = list(range(10, 26))  # any ids every vocabulary has; what matters is that both score them
PROBE_TOKENS = 16
# The largest mean |engine - trainer| logprob difference over the probe that is still the same function:
# float32 on both sides agrees to ~1e-5; a bfloat16 actor's rounding moves single tokens by up to ~0.1.
# Post- vs pre-temperature logprobs of a sampled token differ by ~0.1-0.3 at temperature 0.5 even on the
# near-uniform seeded tiny model.
TOLERANCE = {"float32": 0.02, "bfloat16": 0.2}


def check_attached_serving(
    urls: list[str],
    trainer_logprobs: Callable[[TrainBatch], torch.Tensor],
    *,
    version: int,
    temperature: float,
    compute_dtype: str = "float32",
    model: str | None = None,
) -> None:
    """Probe each engine at `urls` (module docstring): it must label its tokens `version` and return
    the logprobs `trainer_logprobs` (the policy's, at `temperature`) gives them. `model`: the LoRA
    adapter every request names. Raises `RuntimeError` naming each engine's missing flags."""
    problems = []
    for url in urls:
        tokens, engine_logp, labels = _probe(url, temperature, model)
        if not labels:
            problems.append(
                f"{url} labels no token with a weight version (every token would read as version 0): start "
                "it with refit's flags, --middleware refit.vllm_versions.WeightVersions among them "
                "(refit.engine_flags)"
            )
        elif set(labels) != {version}:
            problems.append(
                f"{url} labels its tokens versions {sorted(set(labels))}, not {version} (refit's)"
            )
        prompt = [0] * len(PROBE_PROMPT)
        batch = collate([(PROBE_PROMPT + tokens, prompt + [1] * len(tokens), prompt + engine_logp, 0.0)], 0)
        trainer_logp_T = trainer_logprobs(batch)[0, len(PROBE_PROMPT) :]
        gap = (torch.tensor(engine_logp) - trainer_logp_T).abs().mean().item()
        if gap > TOLERANCE.get(compute_dtype, TOLERANCE["bfloat16"]):
            problems.append(
                f"{url}'s logprobs differ from the trainer's by {gap:.3g} on average at temperature "
                f"{temperature:g}: start it with --logprobs-mode processed_logprobs (the logprobs after the "
                "temperature, which the trainer computes), on the model directory the trainer loads"
            )
    if problems:
        raise RuntimeError(
            "--vllm.urls: an engine serves tokens the trainer cannot train as sampled: "
            + "; ".join(problems)
            + " (molt.vllm_server.engine_args and molt._engines.engine_extra_args are what molt starts its "
            "own engines with); stopping"
        )


def _probe(url: str, temperature: float, model: str | None) -> tuple[list[int], list[float], list[int]]:
    """PROBE_TOKENS tokens sampled after PROBE_PROMPT through vLLM's token interface, as tito asks
    (`tito._engines.Engine.generate`): their ids, logprobs and the version label of each."""
    params = {"max_tokens": PROBE_TOKENS, "temperature": temperature, "logprobs": 0, "detokenize": False}
    body = {"token_ids": PROBE_PROMPT, "sampling_params": {**params, "ignore_eos": True, "seed": 0}}
    if model is not None:
        body["model"] = model
    reply = httpx.post(f"{url.rstrip('/')}/inference/v1/generate", json=body, timeout=120)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    logp = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    labels = []
    for span in choice.get("weight_versions") or ():
        label = span["version"]  # an integer label, or vLLM's "default" for the weights it loaded (0)
        labels += [int(label) if str(label).lstrip("-").isdigit() else 0] * (span["end"] - span["start"])
    return choice["token_ids"], logp, labels
