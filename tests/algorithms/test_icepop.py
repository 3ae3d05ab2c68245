"""IcePop (verl's ``rollout_is_threshold="lower_upper"``): weights outside the bounds are 0, the rest
the untruncated ratio; golden values by hand, and verl's formula (rollout_corr_helper.py) on random data."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import RolloutCorrection, compute_rollout_correction, get_policy_loss

RATIOS = [0.25, 0.6, 1.0, 4.0, 6.0]  # lower 0.5, upper 5.0: the first and the last lie outside


def one_row():
    rho = torch.tensor([RATIOS + [1.0]])  # the last token is padding
    mask = torch.tensor([[1.0] * 5 + [0.0]])
    rollout = torch.full_like(rho, -1.0) * mask
    return (rollout + torch.log(rho)) * mask, rollout, mask


def test_token_icepop_zeroes_the_ratios_outside_the_bounds_and_keeps_the_others_untruncated():
    old, rollout, mask = one_row()
    c = compute_rollout_correction(old, rollout, mask, RolloutCorrection(
        rollout_is="token", rollout_is_threshold=5.0, rollout_is_threshold_lower=0.5))
    assert torch.allclose(c.weights, torch.tensor([[0.0, 0.6, 1.0, 4.0, 0.0, 0.0]]), atol=1e-6)
    assert torch.equal(c.mask, mask)  # unlike rollout_rs, IcePop leaves the response mask alone
    m = c.metrics
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)
    # ESS of the applied weights [0, 0.6, 1, 4, 0]: 1 / mean((w / mean w)^2)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1 / ((0.36 + 1 + 16) / 5 / 1.12 ** 2), rel=1e-5)
    # the same bounds as a float threshold (TIS) truncate instead
    tis = compute_rollout_correction(old, rollout, mask, RolloutCorrection(rollout_is="token", rollout_is_threshold=5.0))
    assert torch.allclose(tis.weights, torch.tensor([[0.25, 0.6, 1.0, 4.0, 5.0, 0.0]]), atol=1e-6)
    assert "rollout_corr/rollout_is_oob_ratio" not in tis.metrics


def test_sequence_icepop_zeroes_whole_samples_by_their_product():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    log_rho = torch.log(torch.tensor([[2.0, 0.5, 2.0], [4.0, 2.0, 1.0]])) * mask  # products 2 and 8
    rollout = -torch.ones_like(mask) * mask
    c = compute_rollout_correction(rollout + log_rho, rollout, mask, RolloutCorrection(
        rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_threshold_lower=0.5))
    assert torch.allclose(c.weights, torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]), atol=1e-5)
    assert c.metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)


def verl_icepop(log_ratio, mask, level, lower, upper):
    """verl's compute_rollout_correction_weights, IcePop branch (verl/trainer/ppo/rollout_corr_helper.py)."""
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-20, 20))
    else:
        raw = torch.exp((log_ratio * mask).sum(-1, keepdim=True).clamp(-20, 20)).expand_as(log_ratio)
    raw = raw * mask
    kept = (raw >= lower) & (raw <= upper)
    return torch.where(kept, raw, torch.zeros_like(raw)).detach()


@pytest.mark.parametrize("level, bounds", [("token", (0.7, 1.4)), ("sequence", (0.3, 3.0))])
def test_icepop_equals_verls_formula_and_carries_no_gradient(level, bounds):
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(6, 9)
    for r in range(6):
        mask[r, 9 - r:] = 0
    rollout = -torch.rand(6, 9, generator=g) * 3 * mask
    old = ((rollout + 0.4 * torch.randn(6, 9, generator=g)) * mask).requires_grad_()
    lower, upper = bounds
    c = compute_rollout_correction(old, rollout, mask, RolloutCorrection(
        rollout_is=level, rollout_is_threshold=upper, rollout_is_threshold_lower=lower))
    want = verl_icepop(old - rollout, mask, level, lower, upper)
    assert torch.allclose(c.weights, want, atol=1e-5) and not c.weights.requires_grad
    assert 0 < float((want == 0)[mask.bool()].float().mean()) < 1  # some zeroed, some kept: the case is not trivial


def test_zeroed_tokens_leave_the_policy_gradient():
    old, rollout, mask = one_row()
    settings = RolloutCorrection(rollout_is="token", rollout_is_threshold=5.0, rollout_is_threshold_lower=0.5)
    weights = compute_rollout_correction(old, rollout, mask, settings).weights
    new = (old + 0.01).requires_grad_()
    loss, _ = get_policy_loss("vanilla")(old_log_prob=old, log_prob=new, advantages=torch.ones_like(old),
                                         response_mask=mask, rollout_is_weights=weights, loss_agg_mode="token-mean")
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 4] == 0 and (new.grad[0, 1:4] != 0).all()


def test_bad_icepop_bounds_name_the_key():
    with pytest.raises(ValueError, match="rollout_is_threshold_lower=3.0: IcePop's lower bound needs"):
        RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0)
    assert RolloutCorrection(rollout_is_threshold_lower=0.5).icepop and not RolloutCorrection().icepop
    assert math.isclose(RolloutCorrection.from_config({"rollout_is": "token", "rollout_is_threshold": 4.0,
                                                       "rollout_is_threshold_lower": 0.5}).rollout_is_threshold_lower,
                        0.5)
