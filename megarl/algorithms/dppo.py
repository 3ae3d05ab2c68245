"""DPPO (arXiv:2602.04879, Qi et al. 2026): a trust region on the policy's divergence, not its ratio.

PPO clips the probability ratio, which over-penalises rare tokens (a tiny probability change is a
large ratio) and under-penalises likely ones. DPPO masks instead the tokens whose *divergence*
from the old policy left the trust region, in the direction the advantage pushes, and trains the
others with a truncated-importance-weighted policy gradient:

    L = -A * sg(min(ratio, clip_ratio_c)) * log_prob * valid

with ``valid`` 1 unless the update already moved the token's probability too far in the
advantage's direction (A > 0: up; otherwise: down). Two divergences, verl's two registered forms
(``policy_loss.loss_mode``):

* ``dppo_tv`` (Binary-TV): ``p - p_old``; A > 0 is valid while ``p - p_old <= clip_ratio_high``,
  otherwise while ``p - p_old >= -clip_ratio_low``;
* ``dppo_kl`` (Binary-KL): the KL of the two-outcome distributions (the token, anything else)
  ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))`` (1e-8 added inside the second
  log, as verl); A > 0 is valid while that is ``<= clip_ratio_high`` or ``p <= p_old``, otherwise
  while it is ``<= clip_ratio_low`` or ``p >= p_old``.

``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` are the divergence bounds here, not ratio
clips; ``clip_ratio_c`` caps the importance weight (verl's ActorConfig default 3.0 applies; the
paper recommends a large cap, verl's example script sets 10000). Metrics, verl's: ``pg_clipfrac``
(masked tokens), ``pg_clipfrac_lower`` (valid tokens whose weight was capped), ``ppo_kl``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.policy_losses import _LOG_RATIO_CLAMP, _clip_range, _metrics, register_policy_loss

ValidMask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], torch.Tensor]


def _tv_valid(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, low: float, high: float):
    moved = torch.exp(log_prob) - torch.exp(old_log_prob)
    return torch.where(advantages > 0, moved <= high, moved >= -low)


def _binary_kl_valid(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, low: float,
                     high: float):
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + \
        (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return torch.where(advantages > 0, (binary_kl <= high) | (prob <= old_prob), (binary_kl <= low) | (prob >= old_prob))


def _dppo_loss(valid_mask: ValidMask, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio,
               clip_ratio_low, clip_ratio_high, clip_ratio_c, global_batch_info, rollout_is_weights):
    if clip_ratio_c <= 0:
        raise ValueError(f"clip_ratio_c (DPPO's importance-weight cap) must be > 0, got {clip_ratio_c}")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    with torch.no_grad():
        valid = valid_mask(log_prob, old_log_prob, advantages, low, high).to(log_prob.dtype)
    pg_losses = -advantages * truncated * log_prob * valid
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    pg_clipfrac = masked_mean(1.0 - valid, response_mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).to(log_prob.dtype) * valid, response_mask)
    return loss, _metrics(pg_clipfrac, pg_clipfrac_lower, ppo_kl)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV: tokens whose probability moved by more than the bound (in A's direction) are masked."""
    return _dppo_loss(_tv_valid, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio,
                      clip_ratio_low, clip_ratio_high, clip_ratio_c, global_batch_info, rollout_is_weights)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL: tokens whose two-outcome KL left the bound (in A's direction) are masked."""
    return _dppo_loss(_binary_kl_valid, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_ratio,
                      clip_ratio_low, clip_ratio_high, clip_ratio_c, global_batch_info, rollout_is_weights)
