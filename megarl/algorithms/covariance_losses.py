"""Clip-Cov and KL-Cov (arXiv:2505.22617, "The Entropy Mechanism of RL for Reasoning LMs").

The policy's entropy falls where tokens with a high covariance between their log-probability and
their advantage are trained; both losses restrain a small share of exactly those tokens, on top
of the PPO surrogate (verl's ``clip_cov`` and ``kl_cov``, ``core_algos.py``):

* ``clip_cov``: PPO's clipped surrogate, and of the tokens PPO's clip left alone whose centred
  covariance ``(A - mean A) * (log_prob - mean log_prob)`` lies in ``(clip_cov_lb, clip_cov_ub)``,
  ``max(1, int(clip_cov_ratio * tokens))`` picked at random have their gradient cut (loss 0);
* ``kl_cov``: the unclipped surrogate ``-A * r``, and the ``max(1, int(kl_cov_ratio * tokens))``
  tokens with the largest covariance get ``+ ppo_kl_coef * |log r|`` as well.

Keys: ``actor_rollout_ref.actor.policy_loss.clip_cov_ratio`` (2e-4), ``clip_cov_lb`` (1.0),
``clip_cov_ub`` (5.0), ``kl_cov_ratio`` (2e-4), ``ppo_kl_coef`` (0.1), verl's defaults. Means,
counts and the random pick are over the micro-batch (one forward), as in verl, and the pick uses
torch's global generator (seeded per rank by megatron). Metrics: ``pg_clipfrac`` (clip_cov: the
cut tokens; kl_cov: the penalised tokens), ``ppo_kl`` (kl_cov: the mean |log r|, as verl reports).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.policy_losses import _clip_range, _metrics, register_policy_loss


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clip, plus a random few high-covariance tokens with no gradient."""
    if clip_cov_ratio <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.clip_cov_ratio={clip_cov_ratio} must be > 0")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    valid = response_mask > 0
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (log_prob - masked_mean(log_prob, response_mask))
        candidates = valid & ~(pg_losses2 > pg_losses1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        where = torch.nonzero(candidates)
        count = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
        where = where[torch.randperm(len(where))[:count].to(where.device)]
        keep = torch.ones_like(advantages)
        keep[where[:, 0], where[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    pg_clipfrac = masked_mean((keep == 0).to(log_prob.dtype), response_mask)
    return loss, _metrics(pg_clipfrac, torch.zeros_like(pg_clipfrac), masked_mean(-log_ratio, response_mask))


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unclipped surrogate, plus a |log-ratio| penalty on the highest-covariance tokens."""
    if kl_cov_ratio <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio={kl_cov_ratio} must be > 0")
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    pg_losses = -advantages * torch.exp(log_ratio)
    penalised = torch.zeros_like(advantages, dtype=torch.bool)
    with torch.no_grad():
        valid = response_mask > 0
        advs, logps = advantages[valid].float(), log_prob[valid].float()
        if len(advs):
            cov = (advs - advs.mean()) * (logps - logps.mean())
            top = torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices
            rows, cols = torch.nonzero(valid, as_tuple=True)
            penalised[rows[top], cols[top]] = True
    pg_losses = torch.where(penalised, pg_losses + ppo_kl_coef * abs_kl, pg_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    pg_clipfrac = masked_mean(penalised.to(log_prob.dtype), response_mask)
    return loss, _metrics(pg_clipfrac, torch.zeros_like(pg_clipfrac), masked_mean(abs_kl, response_mask))
