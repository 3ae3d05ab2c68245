"""SPIN, self-play fine-tuning (Chen et al. 2024, arXiv:2401.01335), as verl's recipe defines it.

SPIN trains a model against its previous iteration: with the logistic loss, one iteration is a DPO
step (Rafailov et al. 2023, arXiv:2305.18290) between a preferred and a dispreferred response,
where the opponent, the reference of DPO's log-ratios, is the model of the previous iteration.
verl's recipe (``recipe/spin``, verl-recipe August 2026) is its online form (the paper's section 7,
a target that moves with the data): each prompt gets two responses from the current model
(``rollout.n=2``), the better-scored one is "chosen" (a tie: the first in batch order), and

    z = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))      (sums over each response's tokens)
    sigmoid: L = -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z);  ipo: L = (z - 1 / (2 beta))^2

averaged over pairs, one optimizer step per batch, with ``beta = actor_rollout_ref.actor.dpo_beta``,
``algorithm.dpo_loss_type`` (sigmoid | ipo) and ``eps = algorithm.dpo_label_smoothing``. The
reference takes the actor's weights every ``trainer.ref_update_freq`` steps (the iterations).

How it runs on megarl's step: the loss of a pair is a function of the two responses' summed
log-probs, so its gradient at the policy the step starts from is a weight on each response's
log-prob gradient, ``dL/dlog pi(c) = f'(z) / N`` and ``-f'(z) / N`` for the rejected one (N pairs).
This estimator computes those weights from the step's old and reference log-probs (both passes run
before it) and gives them as advantages; the update is REINFORCE summed over tokens
(``loss_mode=reinforce``, ``loss_agg_mode=token-sum``), whose gradient is then exactly DPO's, for
the one optimizer step the recipe takes per batch (the config check refuses other settings).
DPO's own numbers are returned as metrics with verl's names (``actor/dpo_loss``, ...).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megarl.algorithms.advantages import Groups, register_adv_estimator

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def preference_pairs(scores: torch.Tensor, index: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rows, rejected rows): in each group of ``index`` (exactly two samples), the higher score is chosen."""
    chosen, rejected = [], []
    for members in Groups.from_index(index, len(scores), scores.device).members:
        if len(members) != 2:
            raise ValueError(f"SPIN pairs the two responses of each prompt, but a prompt has {len(members)}: set "
                             "actor_rollout_ref.rollout.n=2")
        first, second = members
        better_first = bool(scores[first] >= scores[second])  # a tie: the first, as verl's argmax
        chosen.append(first if better_first else second)
        rejected.append(second if better_first else first)
    device = scores.device
    return torch.tensor(chosen, dtype=torch.long, device=device), torch.tensor(rejected, dtype=torch.long, device=device)


def dpo_loss_and_slope(z: torch.Tensor, beta: float, loss_type: str, label_smoothing: float):
    """Per pair: the DPO loss of margin ``z`` and its derivative dL/dz."""
    if loss_type == "sigmoid":
        loss = -torch.nn.functional.logsigmoid(beta * z) * (1 - label_smoothing) \
            - torch.nn.functional.logsigmoid(-beta * z) * label_smoothing
        slope = -beta * (1 - label_smoothing) * torch.sigmoid(-beta * z) + beta * label_smoothing * torch.sigmoid(beta * z)
        return loss, slope
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2, 2 * (z - 1 / (2 * beta))
    raise ValueError(f"algorithm.dpo_loss_type={loss_type!r}: use one of {DPO_LOSS_TYPES}")


@register_adv_estimator("spin", grouped=True, needs_log_probs=True, loss=("reinforce", "token-sum"))
@torch.no_grad()
def compute_spin_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    dpo_beta: float = 0.1,
    dpo_loss_type: str = "sigmoid",
    dpo_label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """DPO's gradient weights per response (see the module docstring), and DPO's metrics."""
    if dpo_beta <= 0:
        raise ValueError(f"actor_rollout_ref.actor.dpo_beta={dpo_beta}: must be > 0")
    mask = response_mask.to(old_log_prob.dtype)
    chosen, rejected = preference_pairs(token_level_rewards.sum(dim=-1), index)
    policy = (old_log_prob * mask).sum(dim=-1)
    reference = (ref_log_prob * mask).sum(dim=-1)
    z = (policy[chosen] - reference[chosen]) - (policy[rejected] - reference[rejected])
    loss, slope = dpo_loss_and_slope(z, dpo_beta, dpo_loss_type, dpo_label_smoothing)
    pairs = len(chosen)
    weights = torch.zeros_like(policy)
    weights[chosen] = -slope / pairs  # REINFORCE minimises -A log pi: A = -dL/dlog pi
    weights[rejected] = slope / pairs
    advantages = weights.unsqueeze(-1) * mask
    return advantages, advantages, spin_metrics(policy, reference, chosen, rejected, z, loss, dpo_beta)


def spin_metrics(policy, reference, chosen, rejected, z, loss, beta) -> dict[str, float]:
    """verl's SPIN metrics (``actor/dpo_loss``, ...), at the policy the step starts from."""
    rewards_chosen = beta * (policy[chosen] - reference[chosen])
    rewards_rejected = beta * (policy[rejected] - reference[rejected])
    return {
        "actor/dpo_loss": float(loss.mean()), "actor/dpo_logits": float(z.mean()),
        "actor/policy_chosen_logps": float(policy[chosen].mean()),
        "actor/policy_rejected_logps": float(policy[rejected].mean()),
        "actor/reference_chosen_logps": float(reference[chosen].mean()),
        "actor/reference_rejected_logps": float(reference[rejected].mean()),
        "actor/rewards_chosen": float(rewards_chosen.mean()), "actor/rewards_rejected": float(rewards_rejected.mean()),
        "actor/rewards_margins": float((rewards_chosen - rewards_rejected).mean()),
        "actor/rewards_accuracies": float((z > 0).float().mean()),  # verl: 1 if the mean margin is > 0
    }
