"""From scored samples to advantages: the algorithm part of one RL step, pure torch.

    token_level_scores --(KL penalty, if algorithm.use_kl_in_reward)--> token_level_rewards
    token_level_rewards (+ values, + greedy baselines) --(registered estimator)--> advantages, returns

Kept apart from the controller so that it is tested without processes.
"""
from __future__ import annotations

from typing import Any

import torch

from megarl.algorithms import apply_kl_penalty, get_adv_estimator


def token_level_rewards(algorithm, token_level_scores: torch.Tensor, response_mask: torch.Tensor,
                        old_log_probs: torch.Tensor | None, ref_log_probs: torch.Tensor | None,
                        kl_ctrl) -> tuple[torch.Tensor, dict[str, float]]:
    """``algorithm``: the typed ``algorithm`` section (``use_kl_in_reward``, ``kl_penalty``)."""
    if not algorithm.use_kl_in_reward:
        return token_level_scores, {}
    if old_log_probs is None or ref_log_probs is None:
        raise ValueError("algorithm.use_kl_in_reward needs old and reference log-probs")
    return apply_kl_penalty(token_level_scores, old_log_probs, ref_log_probs, response_mask, kl_ctrl,
                            algorithm.kl_penalty)


def compute_advantages(algorithm, rewards: torch.Tensor, response_mask: torch.Tensor, uid: list[str],
                       values: torch.Tensor | None = None, reward_baselines: torch.Tensor | None = None,
                       old_log_probs: torch.Tensor | None = None, ref_log_probs: torch.Tensor | None = None,
                       metrics: dict | None = None, dpo_beta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[B, R]`` from ``algorithm.adv_estimator`` (any registered name); the
    metrics an estimator returns (SPIN's DPO numbers) go into ``metrics``; ``dpo_beta``: ``actor.dpo_beta``."""
    a = algorithm
    inputs: dict[str, Any] = dict(
        token_level_rewards=rewards, response_mask=response_mask, index=uid,
        gamma=a.gamma, lam=a.lam, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, sppo_eta=a.sppo_eta,
        dpo_beta=dpo_beta, dpo_loss_type=a.dpo_loss_type,
        dpo_label_smoothing=a.dpo_label_smoothing)
    optional = dict(values=values, reward_baselines=reward_baselines, old_log_prob=old_log_probs,
                    ref_log_prob=ref_log_probs)
    inputs.update({name: value for name, value in optional.items() if value is not None})
    advantages, returns, *extra = get_adv_estimator(a.adv_estimator)(**inputs)
    if extra and metrics is not None:
        metrics.update(extra[0])
    return advantages * response_mask, returns * response_mask
