"""The Megatron critic: values of the states before each response token, and the value update.

The model is a GPTModel whose output layer is a scalar value head (``build_model(...,
role="critic")``), returning ``[b, S, 1]``. The value of response token ``k`` is read at the
position whose output would predict it, as verl does. The loss is verl's clipped value loss
(``compute_value_loss`` with ``critic.cliprange_value``), scaled over micro-batches and
data-parallel ranks exactly like the actor's loss (see ``update``).

Metrics (verl's names), averaged over mini-batches: ``critic/vf_loss``, ``critic/vf_clipfrac``
(a token mean), ``critic/vpred_mean`` (a token mean), ``critic/grad_norm``, ``critic/lr``,
``critic/optimizer_steps``, ``critic/skipped_steps``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megarl.algorithms import compute_value_loss, masked_mean
from megarl.engine.batch import RLBatch
from megarl.engine.optimizer import build_optimizer, wrap_for_training
from megarl.engine.runner import MicroBatch, ModelRunner, response_values
from megarl.engine.settings import CriticSettings
from megarl.engine.update import run_update

_TOKEN_MEANS = ("vf_clipfrac", "vpred_mean")


class MegatronCritic:
    """``compute_values`` and ``update_critic`` on megatron-core critic chunks, with their own optimizer."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], settings: CriticSettings):
        self.settings = settings
        self.model = wrap_for_training(model_chunks, settings.optim.use_distributed_optimizer)
        self.runner = ModelRunner(self.model)
        self.optimizer, self.scheduler = build_optimizer(self.model, settings.optim)

    def compute_values(self, batch: RLBatch) -> torch.Tensor:
        """Values ``[B, R]``; the same on every model-parallel rank, 0 at response padding."""

        def compute(micro_batch: MicroBatch, output: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"values": response_values(output, micro_batch)}

        return self.runner.infer(batch, self.settings.values, compute, ["values"])["values"]

    def update_critic(self, batch: RLBatch) -> dict[str, float]:
        """Regress the values on ``batch.returns`` (clipped around ``batch.values``). Returns metrics."""
        batch.require("values", "returns", purpose="update_critic")
        return run_update(
            "critic", self.runner, self.optimizer, self.scheduler, batch, self.settings.train, self._loss_fn, ["vf_loss"], _TOKEN_MEANS
        )

    def _loss_fn(self, info: dict):
        dp_size = self.runner.dp_size

        def loss(micro_batch: MicroBatch, output: torch.Tensor):
            batch = micro_batch.batch
            mask = batch.response_mask
            vpreds = response_values(output, micro_batch)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds=vpreds,
                returns=batch.returns,
                values=batch.values,
                response_mask=mask,
                cliprange_value=self.settings.cliprange_value,
                loss_agg_mode=self.settings.loss_agg_mode,
                global_batch_info=info,
            )
            tokens = mask.float().sum()
            collected = {
                "vf_loss": vf_loss.detach() / dp_size,
                "vf_clipfrac": vf_clipfrac * tokens,
                "vpred_mean": masked_mean(vpreds.detach(), mask) * tokens,
                "tokens": tokens,
            }
            return vf_loss * micro_batch.count, collected

        return loss
