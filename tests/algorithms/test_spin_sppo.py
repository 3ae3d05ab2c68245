"""SPIN (DPO between the two responses of a prompt) and SPPO (soft-mean-centred rewards, squared log-ratio).

SPIN's estimator gives DPO's gradient weights; the decisive check is that REINFORCE summed over
tokens (``token-sum``) with those advantages has exactly the gradient of DPO's loss, computed here
directly by autograd on the summed log-probs.
"""

import math

import pytest
import torch

from megarl.algorithms import (compute_policy_loss_reinforce, compute_policy_loss_sppo, compute_spin_outcome_advantage,
                               compute_sppo_outcome_advantage, dpo_loss_and_slope, estimator_traits, preference_pairs,
                               soft_mean)
from tests.algorithms import _algo_reference as ref
from tests.algorithms import _loss_reference as lref

# four prompts, two responses each (adjacent rows share a uid), of different lengths
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0],
                     [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
UID = ["a", "a", "b", "b", "c", "c", "d", "d"]
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, -1.0, 2.0]  # prompt c is a tie: the first response is chosen


def outcome_rewards(scores, mask):
    rewards = torch.zeros(mask.shape)
    last = mask.sum(-1) - 1
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores)
    return rewards


def log_probs(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.log(torch.rand(MASK.shape, generator=gen) * 0.9 + 0.05)


def test_preference_pairs_pick_the_better_response_and_the_first_on_a_tie():
    chosen, rejected = preference_pairs(torch.tensor(SCORES), UID)
    assert chosen.tolist() == [0, 3, 4, 7] and rejected.tolist() == [1, 2, 5, 6]
    with pytest.raises(ValueError, match="rollout.n=2"):
        preference_pairs(torch.zeros(3), ["a", "a", "a"])


@pytest.mark.parametrize("loss_type, beta, smoothing", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.3, 0.0)])
def test_dpo_loss_and_slope_match_the_definition_and_autograd(loss_type, beta, smoothing):
    z = torch.tensor([-3.0, -0.2, 0.0, 0.7, 4.0], dtype=torch.float64, requires_grad=True)
    loss, slope = dpo_loss_and_slope(z, beta, loss_type, smoothing)
    assert loss.tolist() == pytest.approx([lref.dpo_pair_loss(v, beta, loss_type, smoothing) for v in z.tolist()])
    (autograd_slope,) = torch.autograd.grad(loss.sum(), z)
    assert torch.allclose(slope, autograd_slope)
    with pytest.raises(ValueError, match="dpo_loss_type"):
        dpo_loss_and_slope(z, beta, "hinge", 0.0)


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_spin_advantages_give_reinforce_token_sum_the_gradient_of_dpo(loss_type, smoothing):
    beta = 0.4
    policy = log_probs(0).requires_grad_()
    reference = log_probs(1)
    rewards = outcome_rewards(SCORES, MASK)
    # DPO directly: the margin z of each pair from the responses' summed log-probs, the loss averaged over pairs
    summed = (policy * MASK).sum(-1)
    gap = summed - (reference * MASK).sum(-1)
    z = torch.stack([gap[c] - gap[r] for c, r in ((0, 1), (3, 2), (4, 5), (7, 6))])
    losses = [lref.dpo_pair_loss(v, beta, loss_type, smoothing) for v in z.tolist()]
    dpo_loss, _ = dpo_loss_and_slope(z, beta, loss_type, smoothing)
    (dpo_grad,) = torch.autograd.grad(dpo_loss.mean(), policy)

    advantages, returns, metrics = compute_spin_outcome_advantage(
        token_level_rewards=rewards, response_mask=MASK, index=UID, old_log_prob=policy.detach(),
        ref_log_prob=reference, dpo_beta=beta, dpo_loss_type=loss_type, dpo_label_smoothing=smoothing)
    update, _ = compute_policy_loss_reinforce(old_log_prob=policy.detach(), log_prob=policy, advantages=advantages,
                                              response_mask=MASK, loss_agg_mode="token-sum")
    (update_grad,) = torch.autograd.grad(update, policy)
    assert torch.allclose(update_grad, dpo_grad, atol=1e-7)
    assert torch.equal(advantages, returns) and (advantages[~MASK.bool()] == 0).all()
    assert metrics["actor/dpo_loss"] == pytest.approx(sum(losses) / 4, rel=1e-5)
    assert metrics["actor/rewards_accuracies"] == pytest.approx(sum(v > 0 for v in z.tolist()) / 4)
    assert metrics["actor/rewards_margins"] == pytest.approx(beta * z.mean().item(), rel=1e-5)
    # the same weights with token-mean would be a different (scaled) gradient: the aggregation matters
    mean_update, _ = compute_policy_loss_reinforce(old_log_prob=policy.detach(), log_prob=policy, advantages=advantages,
                                                   response_mask=MASK, loss_agg_mode="token-mean")
    assert not torch.allclose(torch.autograd.grad(mean_update, policy)[0], dpo_grad)


def test_spin_traits_ask_for_both_log_prob_passes_and_its_update():
    traits = estimator_traits("spin")
    assert traits["needs_log_probs"] and traits["grouped"] and traits["loss"] == ("reinforce", "token-sum")
    assert not estimator_traits("grpo")["needs_log_probs"] and estimator_traits("grpo")["loss"] is None


@pytest.mark.parametrize("beta", [0.0, 0.5, 2.0, -1.0])
def test_soft_mean_matches_its_definition(beta):
    values = torch.tensor([0.3, -1.2, 2.5, 0.0, 40.0 if beta >= 0 else 1.0], dtype=torch.float64)
    if beta > 0:
        values[-1] = 4.0  # exp(beta * 40) would overflow the plain reference, not the stable function
    assert soft_mean(values, beta).item() == pytest.approx(lref.soft_mean(values.tolist(), beta), rel=1e-9)
    big = torch.tensor([500.0, 0.0])  # the stable form does not overflow
    assert soft_mean(big, 2.0).item() == pytest.approx(500.0 - math.log(2) / 2)


def test_sppo_advantage_is_the_reward_minus_the_batch_soft_mean():
    rewards = outcome_rewards(SCORES, MASK)
    adv, ret = compute_sppo_outcome_advantage(token_level_rewards=rewards, response_mask=MASK, sppo_eta=0.7)
    centre = lref.soft_mean(SCORES, 0.7)
    expected = [[(s - centre) * m for m in row] for s, row in zip(SCORES, ref.rows(MASK))]
    assert ref.rows(adv) == [pytest.approx(row) for row in expected]
    assert torch.equal(adv, ret)


def test_sppo_loss_matches_loop_reference_and_starts_as_reinforce():
    old = log_probs(2)
    new = (old + torch.randn(MASK.shape, generator=torch.Generator().manual_seed(3)) * 0.1).requires_grad_()
    adv, _ = compute_sppo_outcome_advantage(token_level_rewards=outcome_rewards(SCORES, MASK), response_mask=MASK)
    empty = MASK.clone()
    empty[3] = 0  # an empty sample does not count
    loss, _ = compute_policy_loss_sppo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=empty, sppo_eta=1.5)
    expected = lref.sppo_loss(ref.rows(old), ref.rows(new), ref.rows(adv), ref.rows(empty), 1.5)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # at the step's starting policy the gradient is REINFORCE's on the summed log-probs with advantage 2 eta A / N
    start = old.clone().requires_grad_()
    loss, _ = compute_policy_loss_sppo(old_log_prob=old, log_prob=start, advantages=adv, response_mask=MASK, sppo_eta=1.5)
    (grad,) = torch.autograd.grad(loss, start)
    assert torch.allclose(grad, -2 * 1.5 * adv * MASK / len(MASK), atol=1e-6)
    with pytest.raises(ValueError, match="token-mean"):
        compute_policy_loss_sppo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=MASK,
                                 loss_agg_mode="seq-mean-token-sum")
