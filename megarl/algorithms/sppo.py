"""SPPO, self-play preference optimisation (Wu et al. 2024, arXiv:2405.00675), as verl's recipe defines it.

The paper's iteration t samples responses from pi_t, estimates each one's win rate P(y > pi_t | x)
with a preference model and regresses the log-ratio log(pi / pi_t)(y|x) toward eta (P - 1/2), so
that pi_{t+1} ~ pi_t exp(eta P): a multiplicative-weights step toward the game's Nash
equilibrium. verl's recipe (``recipe/sppo``, verl-recipe August 2026) keeps the regression and
replaces the win rate by a scored reward R (a reward model or a rule) centred by the batch's soft
mean, and pi_t by the policy of the step (the old log-probs):

* estimator ``sppo`` (``algorithm.adv_estimator``): per sample, ``R - SoftMean_b(R)`` with
  ``SoftMean_b(x) = log(mean(exp(b x))) / b`` over the whole batch (the arithmetic mean when
  b = 0), ``b = algorithm.sppo_eta``; the value on every response token;
* loss ``sppo`` (``actor_rollout_ref.actor.policy_loss.loss_mode``): per sample
  ``(sum_t (log_prob - old_log_prob) - eta * A)^2`` with ``eta = actor_rollout_ref.actor.sppo_eta``,
  averaged over the non-empty samples (verl defines it for ``loss_agg_mode=token-mean`` only).

With one optimizer step per batch the log-ratio starts at 0 and the gradient is REINFORCE's on the
summed log-probs with advantage ``2 eta A``; further mini-batches or epochs on the same batch pull
each sample's log-ratio toward ``eta * A`` and no further.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from megarl.algorithms.advantages import register_adv_estimator
from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.policy_losses import _metrics, register_policy_loss


def soft_mean(values: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(mean(exp(beta * values))) / beta`` (stable), the arithmetic mean when ``beta == 0``."""
    if beta == 0:
        return values.mean()
    return (torch.logsumexp(values * beta, dim=-1) - math.log(values.shape[-1])) / beta


@register_adv_estimator("sppo")
@torch.no_grad()
def compute_sppo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   sppo_eta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's reward minus the batch's soft mean (``algorithm.sppo_eta``), on its response tokens."""
    scores = token_level_rewards.sum(dim=-1)
    centred = scores - soft_mean(scores, sppo_eta)
    advantages = centred.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_policy_loss("sppo")
def compute_policy_loss_sppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    sppo_eta: float = 1.0,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(log pi(y|x) - log pi_old(y|x) - eta * A)^2`` per sample, averaged over samples.

    ``advantages`` holds one value per sample on its response tokens (their mean is taken).
    ``loss_agg_mode`` other than token-mean is refused: verl computes SPPO's loss only for that.
    """
    if loss_agg_mode != "token-mean":
        raise ValueError(f"loss_agg_mode={loss_agg_mode}: SPPO's loss is one square per sample, averaged over samples "
                         "(verl computes it for token-mean only); set actor_rollout_ref.actor.loss_agg_mode=token-mean")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = ((log_prob - old_log_prob) * mask).sum(dim=-1)
    target = sppo_eta * (advantages * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # the sample's value
    per_sample = (log_ratio - target).square()
    per_token = per_sample.unsqueeze(-1).expand_as(log_prob)  # each sample's square, averaged over its tokens
    loss = agg_loss(per_token, response_mask, "seq-mean-token-mean", **dict(global_batch_info or {}))
    ppo_kl = masked_mean(-(log_prob - old_log_prob), response_mask)
    return loss, _metrics(torch.zeros_like(ppo_kl), torch.zeros_like(ppo_kl), ppo_kl)
