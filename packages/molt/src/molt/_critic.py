"""The PPO critic of `--algo.advantage.estimator gae`: a value head on a causal LM, as its own FSDP2 group.

The critic is the policy's architecture with its language-model head replaced by a one-output linear
head (transformers' `*ForTokenClassification`, `num_labels=1`), loaded from `--algo.critic.model` or, by
default, from the policy's initial weights. A freshly made head starts at zero, so every first value is 0
and the first advantages are the returns themselves. It trains with `rlestimators.value_loss` (clipped
around the values before the step) at `--algo.critic.lr`, with the same one-denominator normalisation as
the policy (the step's trainable tokens) through the micro-batch loop both share
(`molt._rank.ModelRank._micro_batch_sums`), and checkpoints beside it (`<step>/critic`).

Alignment: `values_BT[:, t]` is the value of the state in which token t was sampled, read from the hidden
state of token t - 1 (as a logprob in column t comes from the logits of t - 1); column 0 holds 0. The
critic shards its ranks as data parallel only, whatever `--fsdp.tp_size` / `--fsdp.ep_size` the policy
uses (AutoModel's TP and EP plans are written for language-model heads).

Legend: B sequences, T tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch

from molt._batch import StepInputs, TrainBatch, to_device
from molt._group import PolicyGroup
from molt._rank import ModelRank
from molt._sharding import distributed_setup
from molt.config import Config
from rlestimators import masked_sum, value_loss


def data_parallel_only(config: Config) -> Config:
    """`config` with the actor's tensor, context and expert parallel sizes set to 1."""
    fsdp = msgspec.structs.replace(config.fsdp, tp_size=1, cp_size=1, ep_size=1)
    return msgspec.structs.replace(config, fsdp=fsdp)


class CriticWorker(ModelRank):
    """One rank of the critic (`molt._rank.ModelRank` plus the values and the value loss's step)."""

    checkpoint_dir = "critic"

    def _load(self, model_dir: str, world_size: int, trainable: bool) -> torch.nn.Module:
        """A causal LM's body with a one-output value head, sharded over the ranks by AutoModel."""
        import transformers
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

        dtype = getattr(torch, self.config.model.dtype)
        setup = distributed_setup(self.config, world_size, dtype, on_gpu=self.device.type == "cuda")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # the new head is reported as "missing", as intended
        try:
            model_config = transformers.AutoConfig.from_pretrained(model_dir, num_labels=1)
            model_config.classifier_dropout = 0.0  # a value is a regression target: no dropout
            model, loading = transformers.AutoModelForTokenClassification.from_pretrained(
                model_dir, config=model_config, dtype=dtype, output_loading_info=True
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
        head_name = "score" if hasattr(model, "score") else "classifier"  # transformers' two names for it
        if any(key.startswith(f"{head_name}.") for key in loading["missing_keys"]):  # new: values start at 0
            for param in getattr(model, head_name).parameters():  # the weight and any bias
                torch.nn.init.zeros_(param)
        return parallelize_model(model.to(self.device), setup.mesh_context)

    def _learning_rate(self) -> float:
        return self.config.algo.critic.lr

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        head_BT = self._model_outputs(mb)[0][..., 0]  # in the policy's micro-batch layout (packed or not)
        return torch.nn.functional.pad(head_BT[:, :-1], (1, 0)).float()  # value of token t's state

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """V(state before token t) for every column, [B, T] float32 on the CPU."""
        return self._per_micro_batch(batch, self._values)

    def _value_loss(self, mb: TrainBatch, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Forward and backward of one micro-batch's clipped value loss; returns its metric numerators."""
        assert inputs.old_values_BT is not None and inputs.returns_BT is not None  # gae's (`score`)
        mask_BT = to_device(mb.loss_mask_BT, self.device)
        values_BT = self._values(mb)
        loss_sum, metrics = value_loss(
            values_BT,
            to_device(inputs.old_values_BT, self.device),
            to_device(inputs.returns_BT, self.device),
            mask_BT,
            clip=self.config.algo.critic.value_clip,
        )
        (loss_sum / mb.num_tokens).backward()  # the step's one denominator, as for the policy
        return {
            "critic/value_loss": loss_sum.detach(),
            "critic/value_clip_frac": metrics["value_clip_frac"] * (mask_BT != 0).sum(),
            "critic/value_mean": masked_sum(values_BT.detach(), mask_BT),
        }

    def train_step(self, batch: TrainBatch, inputs: StepInputs) -> dict[str, float]:
        """One optimizer step of the clipped value loss over this rank's rows (`inputs.old_values_BT`
        and `inputs.returns_BT`); global metrics."""
        sums = self._micro_batch_sums(batch, self._value_loss, inputs)
        # over the step's tokens, as the policy's; each rank holds rows of its own (data parallel only)
        metrics = {name: value / batch.num_tokens for name, value in sums.items()}
        metrics.update(self._optimizer_step("critic"))
        return metrics


class CriticGroup(PolicyGroup):
    """The driver's handle on the critic's ranks: a `PolicyGroup`'s arguments (`wait`, `log_prefix`), its
    ranks data parallel only (module docstring)."""

    worker_class = CriticWorker

    def __init__(self, model_dir: str | Path, config: Config, num_ranks: int, **kwargs: Any) -> None:
        super().__init__(model_dir, data_parallel_only(config), num_ranks, **kwargs)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Values of every row of `batch`, [B, T], in row order."""
        return self._rows("values", batch)
