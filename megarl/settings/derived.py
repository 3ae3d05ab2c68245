"""What a config implies where the answer lives in a component's registry (its traits).

``megarl.config.derived`` answers from the keys alone; the answers here also ask the registries,
so they sit above the components: the trainer, the planner and the checks read them from here.
"""
from __future__ import annotations

from megarl.algorithms import ADVANTAGE_ESTIMATORS
from megarl.config.derived import old_log_prob_pass as _old_log_prob_pass_from_keys


def critic_enabled(cfg) -> bool:
    """``critic.enable``, or, unset, whether the advantage estimator needs a critic's values."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return needs_values(cfg)


def needs_values(cfg) -> bool:
    """Whether the advantage estimator needs a critic's values (GAE)."""
    return _estimator(cfg)["needs_values"]


def greedy_baselines(cfg) -> bool:
    """Whether each step generates a greedy response per prompt as the estimator's baseline (ReMax)."""
    return _estimator(cfg)["needs_greedy_baseline"]


def grouped_estimator(cfg) -> bool:
    """Whether the estimator compares the responses to one prompt (with rollout.n == 1 it learns nothing)."""
    return _estimator(cfg)["grouped"]


def estimator_reads_log_probs(cfg) -> bool:
    """Whether the estimator reads the old and the reference log-probs (SPIN): both passes run before it."""
    return _estimator(cfg)["needs_log_probs"]


def estimator_loss(cfg) -> tuple[str, str] | None:
    """The (policy loss, loss_agg_mode) the estimator's advantages are the gradient weights of (SPIN), or None."""
    return _estimator(cfg)["loss"]


def old_log_prob_pass(cfg) -> str | None:
    """Why a step runs the separate old-log-prob pass (``megarl.config.derived.old_log_prob_pass``, or an
    estimator that reads the old log-probs), or None when the update's own forward gives them."""
    reason = _old_log_prob_pass_from_keys(cfg)
    if reason is None and estimator_reads_log_probs(cfg):
        return f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} reads the old log-probs before the update"
    return reason


def _estimator(cfg) -> dict[str, bool]:
    """The configured estimator's traits; an unknown name has none (the config check reports it by name)."""
    name = cfg.algorithm.adv_estimator
    if name not in ADVANTAGE_ESTIMATORS:
        return dict(ADVANTAGE_ESTIMATORS.trait_defaults)
    return ADVANTAGE_ESTIMATORS.traits(name)
