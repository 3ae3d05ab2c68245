"""Policy losses that reshape PPO's importance ratio: CISPO, SAPO, GMPO (``geo_mean``) and DRO.

Same inputs and outputs as ``megarl.algorithms.policy_losses`` (read its docstring), with verl's
names and math (``core_algos.py``, checked against verl's August 2026 snapshot):

* ``cispo`` (MiniMax-M1, arXiv:2506.13585): ``L = -sg(clip(r, 1 - low, 1 + high)) * A * log_prob``:
  the ratio is clipped but never zeroes a token's gradient (PPO's clip does, once it is active);
* ``sapo`` (arXiv:2511.20347): a soft gate instead of a clip,
  ``L = -A * sigmoid(tau * (r - 1)) * 4 / tau`` with ``tau = tau_pos`` where A > 0, else ``tau_neg``
  (``actor.tau_pos``, ``actor.tau_neg``); its gradient at r = 1 is PPO's and fades smoothly away
  from it. Aggregated like GSPO: ``seq-mean-token-mean`` unless ``loss_agg_mode`` says otherwise
  (verl always uses ``seq-mean-token-mean``; the config check notes a difference);
* ``geo_mean`` (GMPO, arXiv:2507.20673): one ratio per sequence, the geometric mean of its token
  ratios, each token's log-ratio clipped to ``[-low, high]`` on the side the advantage pushes;
  ``L_i = -mean_t(A) * exp(mean_t(clipped log r))``, averaged over sequences (``loss_agg_mode``
  does not apply to this term, as in verl);
* ``dro`` (Direct Reward Optimization): ``L = -(log_prob * A - dro_beta / 2 * (log_prob - old)^2)``,
  a policy gradient with a quadratic penalty on the log-ratio (``policy_loss.dro_beta`` > 0).

Metrics: ``pg_clipfrac`` (cispo: tokens whose ratio was clipped; geo_mean: clipped tokens with
A > 0), ``pg_clipfrac_lower`` (geo_mean: clipped tokens with A < 0), ``ppo_kl``; 0 where a loss
has no such notion.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.policy_losses import _LOG_RATIO_CLAMP, _clip_range, _metrics, register_policy_loss


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: the clipped ratio, detached, weights a REINFORCE term; clipping never drops a token."""
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = -clipped.detach() * advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    pg_clipfrac = masked_mean((ratio != clipped).to(log_prob.dtype), response_mask)
    return loss, _metrics(pg_clipfrac, torch.zeros_like(pg_clipfrac), masked_mean(-log_ratio, response_mask))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: ``-A * sigmoid(tau (r - 1)) * 4 / tau``, tau by the advantage's sign."""
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures actor.tau_pos={tau_pos} and actor.tau_neg={tau_neg} must be > 0")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device))
    pg_losses = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(torch.zeros_like(ppo_kl), torch.zeros_like(ppo_kl), ppo_kl)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: the geometric mean of the token ratios (clipped in log space) times the mean advantage.

    The mean over sequences counts the non-empty ones over the whole mini-batch (verl: over the
    micro-batch's rows, empty ones included). Rollout-correction weights enter as their geometric
    mean over the sequence, as in verl.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1) + 1e-8
    seq_ratio = torch.exp((pessimistic * mask).sum(dim=-1) / lengths)
    seq_advantage = (advantages * mask).sum(dim=-1) / lengths
    seq_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        seq_losses = seq_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(dim=-1) / lengths)
    per_token = seq_losses.unsqueeze(-1).expand_as(log_prob)  # each sequence's loss, averaged over its tokens
    loss = agg_loss(per_token, response_mask, "seq-mean-token-mean", **dict(global_batch_info or {}))
    clipped = (log_ratio != clamped).to(log_prob.dtype)
    return loss, _metrics(masked_mean(clipped * (advantages > 0), response_mask),
                          masked_mean(clipped * (advantages < 0), response_mask), masked_mean(-log_ratio, response_mask))


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dro_beta: float | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: ``-(log_prob * A - dro_beta / 2 * (log_prob - old_log_prob)^2)`` per token."""
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta={dro_beta}: DRO needs a positive value")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(torch.zeros_like(ppo_kl), torch.zeros_like(ppo_kl), ppo_kl)
