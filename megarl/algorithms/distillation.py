"""On-policy distillation: a teacher model scores the student's own samples, token by token.

The student samples as in GRPO; a frozen teacher computes the log-prob of every sampled token
(``megarl.trainer.teachers``), and the per-token divergence between the two is trained away, as in
verl's ``distillation.*`` (Agarwal et al. 2024, "On-policy distillation of language models"; the
Thinking Machines note on on-policy distillation, 2025). With d = log p_student - log p_teacher of
the sampled token, the per-token losses are the KL estimators of ``megarl.algorithms.kl``
(``distillation_loss.loss_mode``):

- ``k1`` / ``kl``: d, the reverse KL's single-sample estimate (can be negative);
- ``abs``: |d|;  ``k2`` / ``mse``: d^2 / 2;  ``k3`` / ``low_var_kl``: exp(-d) + d - 1 (>= 0).

``loss_max_clamp`` bounds each token's value to [-c, c]. Two ways to train on them
(``use_policy_gradient``):

- a direct loss (False, verl's default; Gu et al. 2024, MiniLLM): the aggregated per-token loss
  (``loss_agg_mode``) is back-propagated through the student's log-probs. ``k1`` cannot be used
  so: its gradient does not depend on the teacher;
- a reward (True): -loss per token, detached, is the advantage of a vanilla PPO-clip policy
  loss (``clip_ratio_low`` / ``clip_ratio_high`` of ``distillation_loss``), with the batch's old
  log-probs.

With ``use_task_rewards`` the actor's own policy loss (GRPO's, from the task reward) is kept and
the distillation loss is added times ``distillation_loss_coef``; without, the distillation loss is
the whole loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.kl import KL_PENALTIES, kl_penalty
from megarl.algorithms.policy_losses import get_policy_loss

TOPK_MODES = ("forward_kl_topk",)  # verl's top-k forward KL: needs the teacher's top-k log-probs (not yet)
ESTIMATOR_MODES = tuple(KL_PENALTIES)  # k1/kl, abs, k2/mse, k3/low_var_kl
POLICY_LOSS_MODES = ("vanilla",)  # as verl: the policy-gradient form uses PPO-clip


@dataclass(frozen=True)
class DistillationLossSettings:
    """verl's ``distillation.distillation_loss`` section, as the actor's loss reads it."""

    loss_mode: str = "k3"
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        problem = loss_settings_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def coef(self) -> float:
        """The distillation loss's weight in the total: ``distillation_loss_coef`` beside the task's loss, else 1."""
        return self.distillation_loss_coef if self.use_task_rewards else 1.0


def loss_settings_problem(s: DistillationLossSettings) -> str | None:
    """What is wrong with ``s`` (None: nothing), in the words of verl's keys."""
    key = "distillation.distillation_loss"
    if s.loss_mode in TOPK_MODES:
        return (f"{key}.loss_mode={s.loss_mode}: the top-k forward KL needs the teacher's top-k log-probs, which "
                f"megarl's teachers do not return yet; use k3 (a direct loss) or k1 with use_policy_gradient=True")
    if s.loss_mode not in ESTIMATOR_MODES:
        return f"{key}.loss_mode={s.loss_mode!r} is not a distillation loss; use one of {list(ESTIMATOR_MODES)}"
    if s.loss_mode in ("k1", "kl") and not s.use_policy_gradient:
        return (f"{key}.loss_mode={s.loss_mode} with use_policy_gradient=False: the gradient of log p_student - "
                f"log p_teacher does not depend on the teacher, so as a direct loss it only lowers the student's "
                f"log-probs; use k3 (or k2, abs) as a direct loss, or use_policy_gradient=True with k1")
    if s.loss_max_clamp is not None and not s.loss_max_clamp > 0:
        return f"{key}.loss_max_clamp={s.loss_max_clamp}: must be > 0 (or null for no clamp)"
    if s.distillation_loss_coef < 0:
        return f"{key}.distillation_loss_coef={s.distillation_loss_coef}: must be >= 0"
    if s.clip_ratio_low < 0 or s.clip_ratio_high < 0:
        return f"{key}.clip_ratio_low/high={s.clip_ratio_low}/{s.clip_ratio_high}: must be >= 0"
    return None


def distillation_token_losses(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                              settings: DistillationLossSettings) -> torch.Tensor:
    """Per-token losses ``[B, R]`` of the student's log-probs against the teacher's (clamped if asked)."""
    losses = kl_penalty(log_probs, teacher_log_probs.to(log_probs.dtype), settings.loss_mode)
    if settings.loss_max_clamp is not None:
        losses = losses.clamp(min=-settings.loss_max_clamp, max=settings.loss_max_clamp)
    return losses


def distillation_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                      response_mask: torch.Tensor, settings: DistillationLossSettings, loss_agg_mode: str = "token-mean",
                      global_batch_info: Mapping[str, Any] | None = None,
                      rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation loss of a micro-batch (before ``settings.coef``) and its metrics: ``token_loss`` (the
    per-token losses' mean over the mask, detached) and, as a reward, ``pg_clipfrac`` and ``ppo_kl``."""
    info = dict(global_batch_info or {})
    losses = distillation_token_losses(log_probs, teacher_log_probs, settings)
    mask = response_mask.to(losses.dtype)
    metrics = {"token_loss": (losses.detach() * mask).sum() / mask.sum().clamp_min(1.0)}  # a micro-batch's mean
    if settings.use_policy_gradient:
        loss, pg_metrics = get_policy_loss("vanilla")(
            old_log_prob=old_log_probs, log_prob=log_probs, advantages=-losses.detach(), response_mask=response_mask,
            loss_agg_mode=loss_agg_mode, clip_ratio=settings.clip_ratio_low, clip_ratio_low=settings.clip_ratio_low,
            clip_ratio_high=settings.clip_ratio_high, global_batch_info=info, rollout_is_weights=rollout_is_weights)
        metrics.update(pg_clipfrac=pg_metrics["pg_clipfrac"], ppo_kl=pg_metrics["ppo_kl"])
        return loss, metrics
    return agg_loss(losses, response_mask, loss_agg_mode, **info), metrics
