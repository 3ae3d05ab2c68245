"""Rollout correction: importance weights and rejection masks for tokens another policy sampled.

verl's ``algorithm.rollout_correction.*`` (its keys, defaults and metric names). Three policies
take part in an off-policy PPO step:

* ``pi_rollout``, the behaviour policy: the fleet's log-probs of the sampled tokens
  (``rollout_log_probs``; with asynchronous training, weights one or more versions old, and a
  partial rollout mixes versions within a sample);
* ``pi_old``, the proximal policy: the trainer's log-probs before the update (``old_log_probs``);
* ``pi_theta``, the policy being trained.

**Decoupled mode** (``bypass_mode=False``): the PPO ratio is ``pi_theta / pi_old``, clipped as usual,
and each token's loss is multiplied by a truncated importance weight (TIS)
``w = min(rho, rollout_is_threshold)`` of ``rho = pi_old / pi_rollout``: per token
(``rollout_is=token``) or the product over the sample (``sequence``). With
``rollout_is_threshold_lower`` set (verl's ``"lower_upper"`` string, IcePop) the weight is instead
``rho`` where ``lower <= rho <= rollout_is_threshold`` and 0 outside: those tokens leave the loss
through their weight, the response mask is unchanged. Rejection sampling (MIS,
``rollout_rs``) masks out tokens (``token``) or whole samples (``sequence``: the product,
``geometric``: the geometric mean ``exp(mean log rho)``) whose ratio lies outside
``[rollout_rs_threshold_lower, rollout_rs_threshold]`` (lower: ``1 / upper`` unless set), and
``rollout_token_veto_threshold`` rejects a sample with any token ratio below it. With
``pi_rollout == pi_old`` every ``rho`` is 1: the weights are 1, nothing is rejected, and the step
is plain PPO.

**Bypass mode** (``bypass_mode=True``, verl's ``use_rollout_log_probs``): ``pi_old := pi_rollout``,
so no trainer forward runs before the update. ``loss_type=ppo_clip``: the PPO ratio
``pi_theta / pi_rollout`` carries the correction (clipped), no extra weight; ``reinforce``: the
REINFORCE loss weighted by the truncated ``rho = pi_theta / pi_rollout``. Rejection sampling uses
that ``rho``. Both are computed inside the loss, per micro-batch, from the detached current
log-probs (``rollout_correction``, called by the engine).

Weights never carry gradient (they change the measure, not the objective). Log-ratios are clamped
at +-20 before ``exp``, as verl does.

Registries: ``ROLLOUT_IS`` (``token``, ``sequence``) and ``ROLLOUT_RS`` (``token``, ``sequence``,
``geometric``) map the per-token log-ratio and mask to a per-token log-ratio of that level; a new
level is one decorated function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megarl.algorithms.masked import masked_mean, masked_sum
from megarl.config.registry import Registry

ROLLOUT_IS = Registry("rollout importance-sampling level", "algorithm.rollout_correction.rollout_is")
ROLLOUT_RS = Registry("rollout rejection-sampling level", "algorithm.rollout_correction.rollout_rs")
LOSS_TYPES = ("ppo_clip", "reinforce")  # bypass mode's losses (algorithm.rollout_correction.loss_type)
SAFETY_BOUND = 20.0  # exp(+-20): the range of a weight before truncation


def register_rollout_is(name: str) -> Callable:
    return ROLLOUT_IS.register(name)


def register_rollout_rs(name: str) -> Callable:
    return ROLLOUT_RS.register(name)


@register_rollout_is("token")
@register_rollout_rs("token")
def token_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token its own ratio."""
    return log_ratio * mask


@register_rollout_is("sequence")
@register_rollout_rs("sequence")
def sequence_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every token of a sample gets the sample's ratio: the product of its tokens' ratios."""
    return masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1).expand_as(log_ratio)


@register_rollout_rs("geometric")
def geometric_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The geometric mean of a sample's token ratios (length-independent; thresholds near 1)."""
    return masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1).expand_as(log_ratio)


@dataclass(frozen=True)
class RolloutCorrection:
    """The settings of ``algorithm.rollout_correction`` (``None`` levels switch a part off)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_threshold_lower: float | None = None  # set: IcePop (weights outside [lower, threshold] are 0)
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def __post_init__(self) -> None:
        problems = correction_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def corrects(self) -> bool:
        """True when some correction for the behaviour policy is chosen (off-policy PPO needs one)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode

    @property
    def icepop(self) -> bool:
        """True when the weights outside ``[rollout_is_threshold_lower, rollout_is_threshold]`` are zeroed."""
        return self.rollout_is_threshold_lower is not None

    @property
    def rs_bounds(self) -> tuple[float, float]:
        upper = float(self.rollout_rs_threshold)
        lower = self.rollout_rs_threshold_lower
        return (1.0 / upper if lower is None else float(lower)), upper

    @classmethod
    def from_config(cls, section: Any) -> "RolloutCorrection":
        def get(key: str, default: Any = None) -> Any:
            value = section.get(key, default) if hasattr(section, "get") else getattr(section, key, default)
            return default if value is None else value

        return cls(rollout_is=get("rollout_is"), rollout_is_threshold=float(get("rollout_is_threshold", 2.0)),
                   rollout_is_threshold_lower=get("rollout_is_threshold_lower"),
                   rollout_is_batch_normalize=bool(get("rollout_is_batch_normalize", False)),
                   rollout_rs=get("rollout_rs"), rollout_rs_threshold=get("rollout_rs_threshold"),
                   rollout_rs_threshold_lower=get("rollout_rs_threshold_lower"),
                   rollout_token_veto_threshold=get("rollout_token_veto_threshold"),
                   bypass_mode=bool(get("bypass_mode", False)), loss_type=str(get("loss_type", "ppo_clip")))


def correction_problems(c: RolloutCorrection, prefix: str = "algorithm.rollout_correction") -> list[str]:
    """Every problem of the settings, one line each, naming the key."""
    problems = []
    if c.rollout_is is not None and c.rollout_is not in ROLLOUT_IS:
        problems.append(f"{prefix}.rollout_is={c.rollout_is!r}: use null or one of {sorted(ROLLOUT_IS)}")
    if c.rollout_rs is not None and c.rollout_rs not in ROLLOUT_RS:
        problems.append(f"{prefix}.rollout_rs={c.rollout_rs!r}: use null or one of {sorted(ROLLOUT_RS)}")
    if not c.rollout_is_threshold > 0:
        problems.append(f"{prefix}.rollout_is_threshold={c.rollout_is_threshold}: must be > 0 (truncation bound)")
    elif c.rollout_is_threshold_lower is not None and not 0 <= c.rollout_is_threshold_lower <= c.rollout_is_threshold:
        problems.append(f"{prefix}.rollout_is_threshold_lower={c.rollout_is_threshold_lower}: IcePop's lower bound "
                        f"needs 0 <= lower <= rollout_is_threshold ({c.rollout_is_threshold})")
    if c.rollout_rs is not None:
        if c.rollout_rs_threshold is None:
            problems.append(f"{prefix}.rollout_rs={c.rollout_rs} needs {prefix}.rollout_rs_threshold (the upper "
                            "bound of accepted ratios; geometric: close to 1, e.g. 1.001)")
        elif not c.rollout_rs_threshold > 0 or (c.rollout_rs_threshold_lower is not None and
                                                 not 0 <= c.rollout_rs_threshold_lower <= c.rollout_rs_threshold):
            problems.append(f"{prefix}.rollout_rs_threshold={c.rollout_rs_threshold}, rollout_rs_threshold_lower="
                            f"{c.rollout_rs_threshold_lower}: need 0 <= lower <= upper and upper > 0")
    if c.rollout_token_veto_threshold is not None and not c.rollout_token_veto_threshold > 0:
        problems.append(f"{prefix}.rollout_token_veto_threshold={c.rollout_token_veto_threshold}: must be > 0")
    if c.loss_type not in LOSS_TYPES:
        problems.append(f"{prefix}.loss_type={c.loss_type!r}: use one of {LOSS_TYPES}")
    return problems


@dataclass
class Correction:
    """What a correction gives one batch: per-token weights (None without IS), the response mask
    with rejected tokens set to 0, and verl's ``rollout_corr/*`` metrics."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, float]


@torch.no_grad()
def compute_rollout_correction(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                               settings: RolloutCorrection, with_metrics: bool = True) -> Correction:
    """Weights and rejection mask for ``rho = exp(log_prob - rollout_log_prob)``.

    ``log_prob`` is the target of the correction: ``pi_old`` in decoupled mode, the current
    policy (detached) in bypass mode. Metrics (verl's names; statistics of the weights before
    truncation, so ``rollout_is_ratio_fraction_high`` is the share that truncation cut):
    ``rollout_corr/rollout_is_{mean,max,min,ratio_fraction_high,ratio_fraction_low,eff_sample_size}``
    (IcePop: plus ``rollout_is_oob_ratio``, the share of tokens whose weight is 0),
    ``rollout_corr/rollout_rs_{masked_fraction,seq_masked_fraction}``,
    ``rollout_corr/rollout_is_veto_fraction``, and the mismatch ``rollout_corr/kl`` (``E[log pi_rollout
    - log pi]``) and ``rollout_corr/k3_kl``. ``with_metrics=False`` skips them (inside a loss, where
    every float would wait for the device).
    """
    if log_prob.shape != rollout_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(f"log_prob {tuple(log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have one shape")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - rollout_log_prob) * mask
    metrics = mismatch_metrics(log_ratio, mask) if with_metrics else {}
    weights = None
    if settings.rollout_is is not None:
        level = ROLLOUT_IS[settings.rollout_is](log_ratio, mask)
        raw = torch.exp(level.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
        weights, lower = importance_weights(raw, settings)
        if with_metrics:
            metrics.update(weight_metrics("rollout_is", raw, level, mask, settings.rollout_is_threshold, lower,
                                          applied=weights if settings.icepop else None))
        if settings.rollout_is_batch_normalize:
            mean = masked_mean(weights, mask)
            if mean > 1e-8:
                weights = weights / mean
            if with_metrics:
                metrics["rollout_corr/rollout_is_batch_norm_factor"] = float(mean)
    kept = torch.ones_like(mask)
    if settings.rollout_rs is not None:
        lower, upper = settings.rs_bounds
        level = ROLLOUT_RS[settings.rollout_rs](log_ratio, mask)
        log_lower = math.log(lower) if lower > 0 else -math.inf
        kept = ((level >= log_lower) & (level <= math.log(upper))).to(mask.dtype)
    if settings.rollout_token_veto_threshold is not None:
        vetoed = ((log_ratio < math.log(settings.rollout_token_veto_threshold)) & mask.bool()).any(-1, keepdim=True)
        kept = kept * (~vetoed).to(mask.dtype)
        if with_metrics:
            metrics["rollout_corr/rollout_is_veto_fraction"] = float(vetoed.float().mean())
    if with_metrics and (settings.rollout_rs is not None or settings.rollout_token_veto_threshold is not None):
        rejected = (1 - kept) * mask
        metrics["rollout_corr/rollout_rs_masked_fraction"] = float(masked_mean(rejected, mask))
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float((rejected.sum(-1) > 0).float().mean())
    new_mask = response_mask * kept.to(response_mask.dtype)
    if weights is not None:
        weights = weights * kept
    return Correction(weights, new_mask, metrics)


def importance_weights(raw: torch.Tensor, settings: RolloutCorrection) -> tuple[torch.Tensor, float]:
    """The applied weights of the untruncated ``raw`` ones, and the lower bound of the metrics.

    TIS: ``min(raw, upper)`` (lower bound of the metrics ``1 / upper``). IcePop (verl's
    ``"lower_upper"`` threshold): ``raw`` where ``lower <= raw <= upper``, else 0, compared on the
    weight of the level (a ``sequence`` weight zeroes the whole sample)."""
    upper, lower = settings.rollout_is_threshold, settings.rollout_is_threshold_lower
    if lower is None:
        return raw.clamp(max=upper), 1.0 / upper
    inside = (raw >= lower) & (raw <= upper)
    return torch.where(inside, raw, torch.zeros_like(raw)), float(lower)


def weight_metrics(prefix: str, weights: torch.Tensor, log_level: torch.Tensor, mask: torch.Tensor, upper: float,
                   lower: float, applied: torch.Tensor | None = None) -> dict[str, float]:
    """Statistics of the untruncated ``weights``. With ``applied`` (IcePop's zeroed weights), the
    effective sample size is that of the applied weights and ``_oob_ratio`` the share of tokens
    zeroed, as verl computes them."""
    valid = mask.bool()
    if not valid.any():
        return {}
    w = weights[valid]
    logs = log_level[valid]
    clamped = w.clamp(lower, upper) if applied is None else applied[valid].clamp(0.0, upper)
    normalised = clamped / (clamped.mean() + 1e-8)
    metrics = {f"rollout_corr/{prefix}_mean": float(w.mean()), f"rollout_corr/{prefix}_max": float(w.max()),
               f"rollout_corr/{prefix}_min": float(w.min()),
               f"rollout_corr/{prefix}_ratio_fraction_high": float((logs > math.log(upper)).float().mean()),
               f"rollout_corr/{prefix}_ratio_fraction_low": float((logs < math.log(lower)).float().mean()
                                                                  if lower > 0 else 0.0),
               f"rollout_corr/{prefix}_eff_sample_size": float(1.0 / (normalised ** 2).mean())}
    if applied is not None:
        metrics[f"rollout_corr/{prefix}_oob_ratio"] = float(((w < lower) | (w > upper)).float().mean())
    return metrics


def mismatch_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the behaviour policy is from the target: ``kl`` = E[log pi_rollout - log pi] and k3."""
    if not mask.bool().any():
        return {}
    k3 = torch.expm1(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - log_ratio
    return {"rollout_corr/kl": float(masked_mean(-log_ratio, mask)), "rollout_corr/k3_kl": float(masked_mean(k3, mask))}
