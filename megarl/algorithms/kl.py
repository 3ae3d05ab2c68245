"""KL penalties between the policy and the reference model, and the KL coefficient controllers.

Estimators (J. Schulman, "Approximating KL divergence", 2020), with d = log_prob - ref_log_prob:

- `kl` / `k1`: d                      (unbiased, can be negative)
- `abs`:       |d|
- `mse` / `k2`: 0.5 * d^2
- `low_var_kl` / `k3`: exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]
  as in verl; always >= 0.

They are used in two places, as in verl:

- as a reward penalty (`algorithm.use_kl_in_reward`, type `algorithm.kl_penalty`):
  `apply_kl_penalty` subtracts beta * KL from the token-level scores, with beta from a
  controller (`algorithm.kl_ctrl`: `type` fixed | adaptive, `kl_coef`, `target_kl`, `horizon`);
- as a loss (`actor_rollout_ref.actor.use_kl_loss`, `kl_loss_type`, `kl_loss_coef`):
  `compute_kl_loss`, added to the policy loss times `kl_loss_coef`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.masked import masked_mean
from megarl.config.registry import Registry

KL_PENALTIES = Registry("KL penalty", "algorithm.kl_penalty / actor_rollout_ref.actor.kl_loss_type")


def register_kl_penalty(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a KL estimator `fn(logprob, ref_logprob) -> [batch, len]` under one or more names."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            KL_PENALTIES.register(name)(fn)
        return fn

    return decorator


@register_kl_penalty("kl", "k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log p_ref (an unbiased but high-variance estimate of KL(p || p_ref))."""
    return logprob - ref_logprob


@register_kl_penalty("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """|log p - log p_ref|."""
    return (logprob - ref_logprob).abs()


@register_kl_penalty("mse", "k2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log p - log p_ref)^2."""
    return 0.5 * (logprob - ref_logprob).square()


@register_kl_penalty("low_var_kl", "k3")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = r - log r - 1 with log r = log p_ref - log p (unbiased, low variance, >= 0).

    As verl: log r is clamped to [-20, 20] and k3 to [-10, 10]. Written as expm1(x) - x, which
    equals exp(x) - x - 1 but cannot round below 0 for small x.
    """
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    kld = torch.expm1(log_ratio) - log_ratio
    return torch.clamp(kld, min=-10, max=10)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate of type `kl_penalty` (a name in `KL_PENALTIES`), `[batch, len]`."""
    return KL_PENALTIES[kl_penalty](logprob, ref_logprob)


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """The KL loss of `actor.use_kl_loss`: agg_loss(kl_penalty(log_prob, ref_log_prob)).

    The caller adds `kl_loss_coef * kl_loss` to the policy loss (verl logs `actor/kl_loss`).
    """
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(kld, response_mask, loss_agg_mode, **dict(global_batch_info or {}))


# ---------------------------------------------------------------------- controllers
class FixedKLController:
    """A constant KL coefficient (`algorithm.kl_ctrl.type=fixed`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. (arXiv:1909.08593), `kl_ctrl.type=adaptive`.

    After each batch: error = clip(current_kl / target_kl - 1, -0.2, 0.2) and
    value *= 1 + error * n_steps / horizon. Checkpoint `state_dict()` to resume the same value.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


KL_CONTROLLERS = ("fixed", "adaptive")  # algorithm.kl_ctrl.type


def get_kl_controller(type: str, kl_coef: float | None, target_kl: float | None = None,
                      horizon: int | None = None) -> KLController:
    """The controller ``algorithm.kl_ctrl`` describes: ``type`` fixed (``kl_coef``) or adaptive (``kl_coef``,
    ``target_kl``, ``horizon``)."""
    if type == "fixed":
        return FixedKLController(kl_coef=_required("kl_coef", kl_coef))
    if type == "adaptive":
        return AdaptiveKLController(init_kl_coef=_required("kl_coef", kl_coef),
                                    target_kl=_required("target_kl", target_kl), horizon=_required("horizon", horizon))
    raise ValueError(f"unknown algorithm.kl_ctrl.type {type!r}. Known names: adaptive, fixed.")


def _required(key: str, value: Any) -> Any:
    if value is None:
        raise ValueError(f"algorithm.kl_ctrl.{key} is not set")
    return value


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The in-reward KL penalty (`algorithm.use_kl_in_reward`), as verl's trainer applies it.

    token_level_rewards = token_level_scores - beta * KL * mask, with beta = kl_ctrl.value.
    The batch KL (per-sequence masked mean, then the mean over sequences) then updates the
    controller with n_steps = batch size. Metrics (verl's names): `actor/reward_kl_penalty`
    (that batch KL) and `actor/reward_kl_penalty_coeff` (the beta that was applied).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = KL_PENALTIES[kl_penalty](old_log_prob, ref_log_prob)
    kld = torch.where(mask.bool(), kld, torch.zeros_like(kld)) * mask  # padding may hold any value
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld

    current_kl = masked_mean(kld, mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
