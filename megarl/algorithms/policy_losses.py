"""Policy losses (`actor_rollout_ref.actor.policy_loss.loss_mode`), with verl's names and math.

Each loss takes `[batch, response_len]` tensors `old_log_prob`, `log_prob`, `advantages`,
`response_mask` plus its options, and returns `(loss, metrics)`: a scalar to minimise and a
dict of detached scalar tensors, `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl`
(the trainer logs them as `actor/<name>`; call `.item()` when logging).

Options (the names of `actor_rollout_ref.actor`): `loss_agg_mode`, `clip_ratio`,
`clip_ratio_low`, `clip_ratio_high` (None: `clip_ratio`), `clip_ratio_c`, and
`global_batch_info`, a dict of `agg_loss`'s global totals (`dp_size`, `batch_num_tokens`,
`global_batch_size`, `loss_scale_factor`) for micro-batch gradient accumulation, and
`rollout_is_weights` (None, or detached per-token importance weights of a rollout correction,
`megarl.algorithms.rollout_correction`) that multiply each token's loss before aggregation, and
the options of particular losses (`LOSS_OPTIONS`: SAPO's `tau_pos`/`tau_neg`, Clip-Cov's and
KL-Cov's, DRO's `dro_beta`, SPPO's `sppo_eta`).

This module holds PPO (`vanilla`), GSPO and REINFORCE (`reinforce`, also `gpg`); the others are
in `dppo` (`dppo_tv`, `dppo_kl`), `ratio_losses` (`cispo`, `sapo`, `geo_mean`, `dro`),
`covariance_losses` (`clip_cov`, `kl_cov`) and `sppo`: every loss of verl's `core_algos` registry
(August 2026) except `bypass_mode`, which megarl spells `algorithm.rollout_correction.bypass_mode`
(verl sets `loss_mode=bypass_mode` from that same key; the engine applies the correction).

The trainer calls the configured loss with one set of arguments; each loss receives only the
arguments it declares (see `registry.UniformCall`):

    loss_fn = get_policy_loss(actor_cfg.policy_loss.loss_mode)
    loss, metrics = loss_fn(old_log_prob=..., log_prob=..., advantages=..., response_mask=...,
                            loss_agg_mode=actor_cfg.loss_agg_mode, clip_ratio=actor_cfg.clip_ratio, ...)

A new loss: `@register_policy_loss("name")` on a function with the same inputs and outputs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from megarl.algorithms.aggregation import agg_loss
from megarl.algorithms.masked import masked_mean
from megarl.config.registry import Registry, UniformCall

POLICY_LOSSES = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")

# The options of particular losses (``PolicyLossSettings.options``; config keys: ``actor.tau_pos``,
# ``actor.tau_neg``, ``actor.sppo_eta``, the others under ``actor.policy_loss``).
LOSS_OPTIONS = (
    "tau_pos", "tau_neg",  # sapo
    "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",  # clip_cov
    "kl_cov_ratio", "ppo_kl_coef",  # kl_cov
    "dro_beta",  # dro
    "sppo_eta",  # sppo
)

# Inputs the trainer may pass to any policy loss; a loss that does not declare one ignores it.
SHARED_POLICY_LOSS_INPUTS = frozenset(
    {
        "old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
        "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "global_batch_info",
        "rollout_is_weights", *LOSS_OPTIONS,
    }
)

# verl clamps log-ratios before exp() so that exp never overflows.
_LOG_RATIO_CLAMP = 20.0
_GSPO_LOG_RATIO_MAX = 10.0


def register_policy_loss(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a policy loss under `name` (selected by `policy_loss.loss_mode`)."""
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> UniformCall:
    """The policy loss registered as `name`, callable with the shared keyword inputs."""
    return UniformCall("policy loss", name, POLICY_LOSSES[name], SHARED_POLICY_LOSS_INPUTS)


def _clip_range(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple[float, float]:
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if low < 0 or high < 0:
        raise ValueError(f"clip ratios must be >= 0, got clip_ratio_low={low}, clip_ratio_high={high}")
    return low, high


def _metrics(pg_clipfrac: torch.Tensor, pg_clipfrac_lower: torch.Tensor, ppo_kl: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": pg_clipfrac.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
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
    """PPO clipped surrogate (arXiv:1707.06347) with DAPO clip-higher and dual-clip.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)); per token
    L = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)), and for A < 0
    additionally L = min(L, -A * clip_ratio_c) (dual-clip, arXiv:1912.09729), so a very large
    ratio cannot make the loss unbounded. Asymmetric `clip_ratio_high` > `clip_ratio_low` is
    DAPO's clip-higher (arXiv:2503.14476).

    Metrics: `pg_clipfrac` (tokens where the clipped term is active), `pg_clipfrac_lower`
    (tokens with A < 0 where the dual-clip bound is active), `ppo_kl` (mean of old - new log-prob).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound on the ratio) must be > 1.0, got {clip_ratio_c}")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:  # a rollout correction's truncated importance weights (verl's place)
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    return loss, _metrics(pg_clipfrac, pg_clipfrac_lower, ppo_kl)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (arXiv:2507.18071): a sequence-level importance ratio, clipped like PPO.

    s_i = exp(mean over the valid tokens of (log_prob - old_log_prob)). Per token the ratio is
    sg[s_i] * pi / sg[pi] (its value is s_i, its gradient that of the token's log-prob), with the
    log clamped at 10. L = max(-A * s, -A * clip(s, 1 - low, 1 + high)), aggregated with
    `loss_agg_mode`; the paper's form, and this function's default, is `seq-mean-token-mean`.
    (verl's GSPO always uses seq-mean-token-mean, whatever `loss_agg_mode` says; megarl honours
    the key, and the config check says so when it differs.) GSPO's papers use tiny clip ratios
    (e.g. 3e-4 / 4e-4).

    Metrics: `pg_clipfrac`, `ppo_kl` (token-level, as vanilla); `pg_clipfrac_lower` is 0.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_lengths = torch.clamp(mask.sum(dim=-1), min=1)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / seq_lengths

    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=_GSPO_LOG_RATIO_MAX))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))

    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(pg_clipfrac, torch.zeros_like(pg_clipfrac), ppo_kl)


@register_policy_loss("gpg")  # verl's name for it (the GPG paper's loss, arXiv:2504.02546)
@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE (Williams 1992): L = -A * log_prob, no importance ratio and no clipping.

    Exact for on-policy updates (one mini-batch per rollout batch, `ppo_epochs=1`); with more
    updates per batch the gradient is no longer corrected for the policy change.
    `old_log_prob` only feeds the `ppo_kl` metric; the clip fractions are 0.
    """
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:  # off-policy REINFORCE: L = -w A log pi, w detached
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(global_batch_info or {}))
    ppo_kl = masked_mean(-(log_prob - old_log_prob), response_mask)
    zero = torch.zeros_like(ppo_kl)
    return loss, _metrics(zero, zero, ppo_kl)
