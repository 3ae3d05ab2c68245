"""What a config implies where the answer lives in a component's registry (its traits).

``megarl.config.derived`` answers from the keys alone; the answers here also ask the registries,
so they sit above the components: the trainer, the planner and the checks read them from here.
"""
from __future__ import annotations

from megarl.algorithms import ADVANTAGE_ESTIMATORS


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


def _estimator(cfg) -> dict[str, bool]:
    """The configured estimator's traits; an unknown name has none (the config check reports it by name)."""
    name = cfg.algorithm.adv_estimator
    if name not in ADVANTAGE_ESTIMATORS:
        return dict(ADVANTAGE_ESTIMATORS.trait_defaults)
    return ADVANTAGE_ESTIMATORS.traits(name)
