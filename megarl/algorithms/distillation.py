"""On-policy distillation: a teacher model scores the student's own samples, token by token.

The student samples as in GRPO; a frozen teacher computes the log-prob of every sampled token
(``megarl.trainer.teachers``), and the per-token divergence between the two is trained away, as in
verl's ``distillation.*`` (Agarwal et al. 2024, "On-policy distillation of language models"; the
Thinking Machines note on on-policy distillation, 2025). With d = log p_student - log p_teacher of
the sampled token, the per-token losses are the KL estimators of ``megarl.algorithms.kl``
(``distillation_loss.loss_mode``):

- ``k1`` / ``kl``: d, the reverse KL's single-sample estimate (can be negative);
- ``abs``: |d|;  ``k2`` / ``mse``: d^2 / 2;  ``k3`` / ``low_var_kl``: exp(-d) + d - 1 (>= 0).

``forward_kl_topk`` (verl's top-k forward KL; Agarwal et al.'s GKD) uses the teacher's whole top-k
instead of one sample: with the teacher's ``k`` most likely next tokens at each response position
(``topk``), the per-token loss is ``sum_v p_T(v) (log p_T(v) - log p_S(v))`` over those ``v``, not
renormalised (the mass outside the top-k is left out, as in verl); ``log_prob_min_clamp`` bounds both
log-probs from below first. It reports ``student_mass`` and ``teacher_mass``, the probability each
model puts on the teacher's top-k.

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

TOPK_MODES = ("forward_kl_topk",)  # verl's top-k forward KL: needs the teacher's top-k log-probs
ESTIMATOR_MODES = tuple(KL_PENALTIES)  # k1/kl, abs, k2/mse, k3/low_var_kl
POLICY_LOSS_MODES = ("vanilla",)  # as verl: the policy-gradient form uses PPO-clip


@dataclass(frozen=True)
class DistillationLossSettings:
    """verl's ``distillation.distillation_loss`` section, as the actor's loss reads it."""

    loss_mode: str = "k3"
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None  # top-k losses: both models' log-probs are clamped from below
    topk: int = 32  # top-k losses: the teacher's most likely tokens per position
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        problem = loss_settings_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode in TOPK_MODES

    @property
    def coef(self) -> float:
        """The distillation loss's weight in the total: ``distillation_loss_coef`` beside the task's loss, else 1."""
        return self.distillation_loss_coef if self.use_task_rewards else 1.0


def loss_settings_problem(s: DistillationLossSettings) -> str | None:
    """What is wrong with ``s`` (None: nothing), in the words of verl's keys."""
    key = "distillation.distillation_loss"
    if s.loss_mode not in ESTIMATOR_MODES + TOPK_MODES:
        return (f"{key}.loss_mode={s.loss_mode!r} is not a distillation loss; use one of "
                f"{list(ESTIMATOR_MODES + TOPK_MODES)}")
    if s.uses_topk and s.topk < 1:
        return f"{key}.topk={s.topk}: the top-k loss needs at least one teacher token per position"
    if s.log_prob_min_clamp is not None and not s.uses_topk:
        return (f"{key}.log_prob_min_clamp={s.log_prob_min_clamp}: verl clamps log-probs in its top-k losses only; "
                f"with loss_mode={s.loss_mode} use loss_max_clamp, or set log_prob_min_clamp=null")
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


def topk_token_losses(student_topk: torch.Tensor, teacher_topk: torch.Tensor,
                      settings: DistillationLossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``forward_kl_topk``'s per-token losses ``[B, R]`` from both models' log-probs ``[B, R, k]`` of the
    teacher's top-k tokens, and each token's ``student_mass`` / ``teacher_mass`` on them."""
    student, teacher = student_topk.float(), teacher_topk.to(student_topk.device).float()
    masses = {"student_mass": student.detach().exp().sum(-1), "teacher_mass": teacher.exp().sum(-1)}
    if settings.log_prob_min_clamp is not None:
        student = student.clamp_min(settings.log_prob_min_clamp)
        teacher = teacher.clamp_min(settings.log_prob_min_clamp)
    losses = (teacher.exp() * (teacher - student)).sum(-1)
    if settings.loss_max_clamp is not None:
        losses = losses.clamp(min=-settings.loss_max_clamp, max=settings.loss_max_clamp)
    return losses, masses


def distillation_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor | None,
                      response_mask: torch.Tensor, settings: DistillationLossSettings, loss_agg_mode: str = "token-mean",
                      global_batch_info: Mapping[str, Any] | None = None,
                      rollout_is_weights: torch.Tensor | None = None, student_topk: torch.Tensor | None = None,
                      teacher_topk: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation loss of a micro-batch (before ``settings.coef``) and its metrics: ``token_loss`` (the
    per-token losses' mean over the mask, detached), as a reward ``pg_clipfrac`` and ``ppo_kl``, and with a
    top-k loss (``student_topk`` / ``teacher_topk``: ``[B, R, k]`` log-probs of the teacher's top-k tokens)
    the masses' means."""
    info = dict(global_batch_info or {})
    mask = response_mask.to(log_probs.dtype)
    count = mask.sum().clamp_min(1.0)
    metrics = {}
    if settings.uses_topk:
        if student_topk is None or teacher_topk is None:
            raise ValueError(f"loss_mode={settings.loss_mode} needs the student's and the teacher's top-k log-probs")
        losses, masses = topk_token_losses(student_topk, teacher_topk, settings)
        metrics.update({name: (value * mask).sum() / count for name, value in masses.items()})
    else:
        losses = distillation_token_losses(log_probs, teacher_log_probs, settings)
    metrics["token_loss"] = (losses.detach() * mask).sum() / count  # a micro-batch's mean
    if settings.use_policy_gradient:
        loss, pg_metrics = get_policy_loss("vanilla")(
            old_log_prob=old_log_probs, log_prob=log_probs, advantages=-losses.detach(), response_mask=response_mask,
            loss_agg_mode=loss_agg_mode, clip_ratio=settings.clip_ratio_low, clip_ratio_low=settings.clip_ratio_low,
            clip_ratio_high=settings.clip_ratio_high, global_batch_info=info, rollout_is_weights=rollout_is_weights)
        metrics.update(pg_clipfrac=pg_metrics["pg_clipfrac"], ppo_kl=pg_metrics["ppo_kl"])
        return loss, metrics
    return agg_loss(losses, response_mask, loss_agg_mode, **info), metrics
