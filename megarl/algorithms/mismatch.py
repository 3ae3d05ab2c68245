"""How far the trainer's log-probs are from the fleet's on the sampled tokens, under megarl's and verl's names.

megarl reports the absolute log-prob difference over the loss mask (``rollout/logprob_diff``, its
mean, and ``rollout/logprob_diff_max``). verl reports the absolute difference of the
*probabilities* (``exp`` of each), over the response mask, as ``training/rollout_probs_diff_max``,
``_mean`` and ``_std`` (``torch.std``: with Bessel's correction). Both are logged, so a verl user's
dashboards and alerts keep working. The update's on-policy probe sees the batch in micro-batches,
so it collects sums (``probs_diff_sums``) and ``verl_probs_diff`` finishes them.
"""
from __future__ import annotations

import math

import torch

VERL_PREFIX = "training/rollout_probs_diff_"


def rollout_mismatch_metrics(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                             mask: torch.Tensor) -> dict[str, float]:
    """megarl's and verl's mismatch metrics of a whole batch ([batch, response] tensors)."""
    keep = mask.bool()
    log_diff = (log_probs - rollout_log_probs).abs()[keep]
    if log_diff.numel() == 0:
        return {}
    probs_diff = (log_probs.exp() - rollout_log_probs.exp()).abs()[keep]
    return {"rollout/logprob_diff": float(log_diff.mean()), "rollout/logprob_diff_max": float(log_diff.max()),
            f"{VERL_PREFIX}max": float(probs_diff.max()), f"{VERL_PREFIX}mean": float(probs_diff.mean()),
            f"{VERL_PREFIX}std": float(probs_diff.std()) if probs_diff.numel() > 1 else float("nan")}


def probs_diff_sums(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A micro-batch's share of verl's metrics: the sum and sum of squares of the masked probability
    differences, and their max."""
    diff = (log_probs.exp() - rollout_log_probs.exp()).abs() * mask
    return {"probs_diff": diff.sum(), "probs_diff_sq": (diff * diff).sum(), "probs_diff_max": diff.max()}


def verl_probs_diff(mean: float, mean_sq: float, largest: float, tokens: float) -> dict[str, float]:
    """verl's metrics from the token means of ``probs_diff_sums`` over ``tokens`` masked tokens."""
    variance = max(mean_sq - mean * mean, 0.0) * tokens / (tokens - 1) if tokens > 1 else float("nan")
    return {f"{VERL_PREFIX}max": largest, f"{VERL_PREFIX}mean": mean, f"{VERL_PREFIX}std": math.sqrt(variance)}
