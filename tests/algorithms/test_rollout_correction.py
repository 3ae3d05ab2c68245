"""Rollout correction (TIS / MIS, bypass) against a reference loop written token by token here."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    ROLLOUT_IS,
    ROLLOUT_RS,
    RolloutCorrection,
    agg_loss,
    compute_rollout_correction,
    get_policy_loss,
)


def batch(seed=0, rows=5, width=7, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, width)
    for r in range(rows):
        mask[r, width - r:] = 0  # responses of different lengths
    old = -torch.rand(rows, width, generator=g) * 3
    rollout = old + spread * torch.randn(rows, width, generator=g)
    return old * mask, rollout * mask, mask


def reference(old, rollout, mask, is_level, threshold, rs_level, upper, lower, veto):
    """Token by token: weights and kept mask, as the docstring of rollout_correction defines them."""
    rows, width = mask.shape
    weights, kept = torch.zeros(rows, width), torch.zeros(rows, width)
    for r in range(rows):
        valid = [t for t in range(width) if mask[r, t] > 0]
        ratios = {t: float(old[r, t] - rollout[r, t]) for t in valid}
        seq = sum(ratios.values())
        geo = seq / len(valid) if valid else 0.0
        rejected = veto is not None and any(v < math.log(veto) for v in ratios.values())
        for t in valid:
            level_is = {"token": ratios[t], "sequence": seq, None: 0.0}[is_level]
            weights[r, t] = min(math.exp(max(min(level_is, 20), -20)), threshold)
            level_rs = {"token": ratios[t], "sequence": seq, "geometric": geo, None: 0.0}[rs_level]
            inside = rs_level is None or math.log(lower) <= level_rs <= math.log(upper)
            kept[r, t] = 1.0 if inside and not rejected else 0.0
    return weights * kept, kept


@pytest.mark.parametrize("is_level", [None, "token", "sequence"])
@pytest.mark.parametrize("rs_level", [None, "token", "sequence", "geometric"])
def test_weights_and_rejection_match_the_reference_loop(is_level, rs_level):
    old, rollout, mask = batch()
    upper = {"token": 1.5, "sequence": 3.0, "geometric": 1.1, None: 2.0}[rs_level]
    settings = RolloutCorrection(rollout_is=is_level, rollout_is_threshold=1.8, rollout_rs=rs_level,
                                 rollout_rs_threshold=upper if rs_level else None, rollout_token_veto_threshold=0.3)
    got = compute_rollout_correction(old, rollout, mask, settings)
    want_w, want_kept = reference(old, rollout, mask, is_level, 1.8, rs_level, upper, 1 / upper, 0.3)
    assert torch.equal(got.mask, mask * want_kept)
    if is_level is None:
        assert got.weights is None
    else:
        assert torch.allclose(got.weights, want_w * mask, atol=1e-6)
        assert got.weights.max() <= 1.8 + 1e-6
        assert 0 < got.metrics["rollout_corr/rollout_is_ratio_fraction_high"] < 1  # truncation cut some
    if rs_level is not None:
        rejected = float(((1 - want_kept) * mask).sum() / mask.sum())
        assert got.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected)


def test_token_is_metrics_are_those_of_the_untruncated_weights():
    old, rollout, mask = batch(seed=3)
    got = compute_rollout_correction(old, rollout, mask, RolloutCorrection(rollout_is="token", rollout_is_threshold=1.2))
    raw = torch.exp(old - rollout)[mask.bool()]
    assert got.metrics["rollout_corr/rollout_is_mean"] == pytest.approx(float(raw.mean()), rel=1e-6)
    assert got.metrics["rollout_corr/rollout_is_max"] == pytest.approx(float(raw.max()), rel=1e-6)
    assert got.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(float((raw > 1.2).float().mean()))
    assert got.metrics["rollout_corr/kl"] == pytest.approx(float((rollout - old)[mask.bool()].mean()), abs=1e-6)


def test_behaviour_equal_to_proximal_is_plain_ppo():
    """rho = 1 everywhere: weights 1, nothing rejected, and the weighted PPO loss is PPO's."""
    old, _, mask = batch()
    g = torch.Generator().manual_seed(1)
    new = old + 0.1 * torch.randn(old.shape, generator=g)
    advantages = torch.randn(old.shape, generator=g)
    for is_level in ROLLOUT_IS:
        for rs_level in ROLLOUT_RS:
            settings = RolloutCorrection(rollout_is=is_level, rollout_rs=rs_level, rollout_rs_threshold=1.0001)
            c = compute_rollout_correction(old, old, mask, settings)
            assert torch.equal(c.mask, mask) and torch.allclose(c.weights, mask)
            loss = get_policy_loss("vanilla")
            plain, _ = loss(old_log_prob=old, log_prob=new, advantages=advantages, response_mask=mask)
            weighted, _ = loss(old_log_prob=old, log_prob=new, advantages=advantages, response_mask=c.mask,
                               rollout_is_weights=c.weights)
            assert torch.allclose(plain, weighted, atol=1e-7)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "reinforce"])
def test_policy_losses_multiply_each_tokens_loss_by_its_weight(mode):
    old, rollout, mask = batch(seed=2)
    g = torch.Generator().manual_seed(4)
    new = (old + 0.05 * torch.randn(old.shape, generator=g)).requires_grad_()
    advantages = torch.randn(old.shape, generator=g)
    weights = compute_rollout_correction(old, rollout, mask, RolloutCorrection(rollout_is="token")).weights
    loss_fn = get_policy_loss(mode)
    weighted, _ = loss_fn(old_log_prob=old, log_prob=new, advantages=advantages, response_mask=mask,
                          rollout_is_weights=weights, loss_agg_mode="token-mean")
    # reference: the per-token losses of the unweighted loss, recovered with a one-hot trick
    per_token = torch.zeros(old.shape)
    for r in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[r, t]:
                only = torch.zeros_like(mask)
                only[r, t] = 1
                value, _ = loss_fn(old_log_prob=old, log_prob=new, advantages=advantages, response_mask=only,
                                   loss_agg_mode="token-mean")
                per_token[r, t] = value.detach() if mode != "gspo" else 0.0
    if mode == "gspo":  # its sequence ratio spans tokens: check the weighting on the loss matrix instead
        unweighted, _ = loss_fn(old_log_prob=old, log_prob=new, advantages=advantages, response_mask=mask,
                                rollout_is_weights=torch.ones_like(mask), loss_agg_mode="token-mean")
        plain, _ = loss_fn(old_log_prob=old, log_prob=new, advantages=advantages, response_mask=mask,
                           loss_agg_mode="token-mean")
        assert torch.allclose(unweighted, plain) and not torch.allclose(weighted, plain)
        return
    assert torch.allclose(weighted, (per_token * weights).sum() / mask.sum(), atol=1e-6)
    weighted.backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()


def test_weights_carry_no_gradient():
    old, rollout, mask = batch()
    old = old.clone().requires_grad_()
    c = compute_rollout_correction(old, rollout, mask, RolloutCorrection(rollout_is="sequence"))
    assert not c.weights.requires_grad


def test_bypass_reinforce_is_weighted_reinforce_and_bypass_ppo_is_the_ratio_to_the_rollout():
    """What the engine does per micro-batch in bypass mode, written with the public pieces."""
    _, rollout, mask = batch(seed=5)
    g = torch.Generator().manual_seed(6)
    current = rollout + 0.3 * torch.randn(rollout.shape, generator=g)
    advantages = torch.randn(rollout.shape, generator=g)
    settings = RolloutCorrection(rollout_is="token", rollout_is_threshold=1.5, bypass_mode=True, loss_type="reinforce")
    c = compute_rollout_correction(current, rollout, mask, settings, with_metrics=False)
    assert c.metrics == {}
    loss, _ = get_policy_loss("reinforce")(old_log_prob=rollout, log_prob=current, advantages=advantages,
                                           response_mask=c.mask, rollout_is_weights=c.weights)
    w = torch.exp(current - rollout).clamp(max=1.5) * mask
    assert torch.allclose(loss, agg_loss(-advantages * current * w, mask, "token-mean"), atol=1e-6)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="rollout_is='tokens': use null or one of"):
        RolloutCorrection(rollout_is="tokens")
    with pytest.raises(ValueError, match="rollout_rs=geometric needs algorithm.rollout_correction.rollout_rs_threshold"):
        RolloutCorrection(rollout_rs="geometric")
    with pytest.raises(ValueError, match="loss_type='ppo': use one of"):
        RolloutCorrection(loss_type="ppo")
    assert not RolloutCorrection().corrects
    assert RolloutCorrection(bypass_mode=True).corrects and RolloutCorrection(rollout_is="token").corrects
