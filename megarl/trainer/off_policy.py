"""The step's side of off-policy data: the rollout correction it applies and the staleness it logs.

``correct`` (decoupled mode, ``algorithm.rollout_correction.bypass_mode=False``): the importance
weights ``pi_old / pi_rollout`` and the rejection mask, from the trainer's old log-probs and the
fleet's; they go into the update's batch (``rollout_is_weights``; rejected tokens leave its
``response_mask``), and their ``rollout_corr/*`` metrics into the step's. In bypass mode the engine
corrects inside the loss (``megarl.engine.actor``) and nothing is done here.

``staleness_metrics``: per sample, how many versions its first token lags the weights it trains
on (``training/off_policy/staleness/{mean,max,min}``), how many versions it spans
(``trajectory_spans``: 1 unless a sync interrupted it), the share of partial samples
(``partial_ratio``) and of stale ones (``stale_ratio``).
"""
from __future__ import annotations

import torch

from megarl.algorithms.rollout_correction import RolloutCorrection, compute_rollout_correction


def correct(settings: RolloutCorrection, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """(the mask to train with, the importance weights or None, metrics)."""
    if settings.bypass_mode or not (settings.rollout_is or settings.rollout_rs or settings.rollout_token_veto_threshold):
        return mask, None, {}
    c = compute_rollout_correction(old_log_probs, rollout_log_probs, mask, settings)
    return c.mask, c.weights, c.metrics


def staleness_metrics(versions: torch.Tensor, first_version: torch.Tensor, mask: torch.Tensor,
                      policy_version: int) -> dict[str, float]:
    """``versions`` [B, R] (-1: not sampled / unknown), ``first_version`` [B]; the weights train from
    ``policy_version``."""
    known = (versions >= 0) & mask.bool()
    lag = (policy_version - first_version).float()
    spans = torch.where(known, versions, torch.iinfo(torch.long).min).max(-1).values - \
        torch.where(known, versions, torch.iinfo(torch.long).max).min(-1).values + 1
    spans = torch.where(known.any(-1), spans, torch.ones_like(spans)).float()
    return {"training/off_policy/staleness/mean": float(lag.mean()),
            "training/off_policy/staleness/max": float(lag.max()),
            "training/off_policy/staleness/min": float(lag.min()),
            "training/off_policy/trajectory_spans/mean": float(spans.mean()),
            "training/off_policy/trajectory_spans/max": float(spans.max()),
            "training/off_policy/partial_ratio": float((spans > 1).float().mean()),
            "training/off_policy/stale_ratio": float((lag > 0).float().mean())}
