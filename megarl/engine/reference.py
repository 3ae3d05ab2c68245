"""The reference policy: a frozen copy of the initial model, for the KL terms and SPIN's DPO (log-probs).

No DDP wrapper, no optimizer state, no gradients: its parameters are set to
``requires_grad=False`` and every forward runs under ``torch.no_grad``. ``take_weights`` copies
the actor's current weights into it (``trainer.ref_update_freq``: SPIN's opponent is the previous
iteration's model); both models have the same layout on a rank, so the copy is local.

With LoRA the initial model is the actor's own frozen base: ``BaseModelReference`` runs the actor's
chunks with every adapter off, so no second model is built or held.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megarl.engine.batch import RLBatch
from megarl.engine.runner import MicroBatch, ModelRunner, response_log_probs
from megarl.engine.settings import BatchSettings
from megarl.models.loading import unwrap


class MegatronReference:
    """``compute_ref_log_prob`` on frozen megatron-core model chunks (e.g. ``build_model(..., role="ref")``)."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], settings: BatchSettings, temperature: float = 1.0):
        for chunk in model_chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        self.runner = ModelRunner(model_chunks)
        self.settings = settings
        self.temperature = temperature

    def compute_ref_log_prob(self, batch: RLBatch) -> torch.Tensor:
        """Reference log-probs ``[B, R]`` of ``batch.responses``; the same on every model-parallel rank."""

        def compute(micro_batch: MicroBatch, logits: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"log_probs": response_log_probs(logits, micro_batch, self.temperature)[0]}

        return self.runner.infer(batch, self.settings, compute, ["log_probs"])["log_probs"]


    @torch.no_grad()
    def take_weights(self, actor_chunks: Sequence[torch.nn.Module]) -> None:
        """Copy every parameter of the actor's chunks (DDP-wrapped or not) into this model's."""
        for source, target in zip(actor_chunks, self.runner.chunks, strict=True):
            own = dict(unwrap(target).named_parameters())
            given = dict(unwrap(source).named_parameters())
            if own.keys() != given.keys():
                raise RuntimeError(f"the reference's parameters differ from the actor's: {sorted(own.keys() ^ given.keys())[:4]}")
            for name, param in own.items():
                param.copy_(given[name])


class BaseModelReference:
    """``compute_ref_log_prob`` with the actor's model chunks, their LoRA adapters switched off."""

    def __init__(self, actor, settings: BatchSettings, temperature: float = 1.0):
        self.runner = actor.runner
        self.settings = settings
        self.temperature = temperature

    def compute_ref_log_prob(self, batch: RLBatch) -> torch.Tensor:
        from megarl.models.lora import adapters_disabled

        def compute(micro_batch: MicroBatch, logits: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"log_probs": response_log_probs(logits, micro_batch, self.temperature)[0]}

        with adapters_disabled(self.runner.chunks):
            return self.runner.infer(batch, self.settings, compute, ["log_probs"])["log_probs"]
