"""Policy losses: hand-computed PPO clip, loop references, gradients, extremes, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import _algo_reference as ref
from megarl.algorithms import (
    LOSS_AGG_MODES,
    compute_policy_loss_gspo,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_policy_loss,
)

# Five valid tokens covering every PPO case, plus one padding token holding garbage.
LOG_RATIO = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.5)], [math.log(0.5), math.log(5.0), 50.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def losses_for(log_ratio, **kwargs):
    old = torch.full_like(log_ratio, -2.0)
    return compute_policy_loss_vanilla(old_log_prob=old, log_prob=old + log_ratio, advantages=ADV, response_mask=MASK, **kwargs)


def test_vanilla_hand_computed():
    loss, metrics = losses_for(LOG_RATIO, clip_ratio=0.2)
    # per token: A=1,r=1.5 -> -1.2 (clipped); A=1,r=0.5 -> -0.5; A=-1,r=1.5 -> 1.5;
    # A=-1,r=0.5 -> 0.8 (clipped); A=-1,r=5 -> min(5, clip_ratio_c=3) = 3 (dual-clipped)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8 + 3.0) / 5, rel=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    expected_kl = -(2 * math.log(1.5) + 2 * math.log(0.5) + math.log(5.0)) / 5
    assert metrics["ppo_kl"].item() == pytest.approx(expected_kl, rel=1e-5)
    assert all(not v.requires_grad for v in metrics.values())


def test_vanilla_clip_higher_and_dual_clip_bound():
    loss, _ = losses_for(LOG_RATIO, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8 + 3.0) / 5, rel=1e-6)
    loss, metrics = losses_for(LOG_RATIO, clip_ratio=0.2, clip_ratio_c=10.0)  # bound above ratio 5: inactive
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8 + 5.0) / 5, rel=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        losses_for(LOG_RATIO, clip_ratio_c=1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("low, high, clip_c", [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)])
def test_vanilla_matches_loop_reference(mode, low, high, clip_c):
    gen = torch.Generator().manual_seed(LOSS_AGG_MODES.index(mode) * 100 + round(high * 100))
    old = -torch.rand(5, 8, generator=gen) * 3
    new = old + torch.randn(5, 8, generator=gen) * 0.6
    adv = torch.randn(5, 8, generator=gen)
    mask = (torch.rand(5, 8, generator=gen) > 0.3).long()
    mask[1] = 0
    loss, metrics = compute_policy_loss_vanilla(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=mode,
        clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c,
    )
    token = [[ref.ppo_token_loss(n - o, a, low, high, clip_c) for n, o, a in zip(nr, orow, ar)]
             for nr, orow, ar in zip(ref.rows(new), ref.rows(old), ref.rows(adv))]
    m = ref.rows(mask)
    assert loss.item() == pytest.approx(ref.aggregate([[t[0] for t in row] for row in token], m, mode), rel=1e-5, abs=1e-6)
    valid = [t for row, mr in zip(token, m) for t, mm in zip(row, mr) if mm]
    assert metrics["pg_clipfrac"].item() == pytest.approx(sum(t[1] for t in valid) / len(valid), abs=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(sum(t[2] for t in valid) / len(valid), abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gspo_matches_loop_reference_under_each_loss_agg_mode(mode):
    """GSPO's clipped sequence-ratio losses, aggregated with `loss_agg_mode` (verl hard-codes
    seq-mean-token-mean there; megarl honours the key, and that mode is the default)."""
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=gen) * 3
    new = old + torch.randn(4, 6, generator=gen) * 0.01
    adv = torch.randn(4, 1, generator=gen).expand(4, 6).contiguous()
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    low, high = 0.003, 0.004
    loss, metrics = get_policy_loss("gspo")(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=mode,
        clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0,
    )
    token_losses, clipped = [], []
    for nr, orow, ar, mr in zip(ref.rows(new), ref.rows(old), ref.rows(adv), ref.rows(mask)):
        diffs = [n - o for n, o, mm in zip(nr, orow, mr) if mm]
        s = math.exp(sum(diffs) / max(len(diffs), 1))
        s_clipped = max(1 - low, min(1 + high, s))
        token_losses.append([max(-a * s, -a * s_clipped) for a in ar])
        clipped += [(-a * s_clipped) > (-a * s) for a, mm in zip(ar, mr) if mm]
    assert loss.item() == pytest.approx(ref.aggregate(token_losses, ref.rows(mask), mode), rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped), abs=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    # the modes disagree on this batch, so the key changes the loss (no mode is silently replaced)
    others = {m: ref.aggregate(token_losses, ref.rows(mask), m) for m in
              ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm") if m != mode}
    assert all(abs(value - loss.item()) > 1e-4 for value in others.values()), others


def test_gspo_default_aggregation_is_seq_mean_token_mean():
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 5, generator=gen)
    new = old + torch.randn(3, 5, generator=gen) * 0.1
    adv = torch.randn(3, 1, generator=gen).expand(3, 5).contiguous()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    default, _ = compute_policy_loss_gspo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask)
    explicit, _ = compute_policy_loss_gspo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                           loss_agg_mode="seq-mean-token-mean")
    assert default.item() == explicit.item()


def test_gspo_gradient_is_sequence_ratio_times_token_gradient():
    """Unclipped, d loss / d log_prob[i, t] = -A_i * s_i / (|y_i| * number of non-empty sequences)."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]])
    new = (old + torch.tensor([[0.1, -0.2, 0.3], [0.05, 0.0, 9.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = compute_policy_loss_gspo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, clip_ratio=10.0)
    loss.backward()
    s0, s1 = math.exp((0.1 - 0.2 + 0.3) / 3), math.exp(0.05 / 2)
    expected = [[-1 * s0 / 3 / 2] * 3, [2 * s1 / 2 / 2, 2 * s1 / 2 / 2, 0.0]]
    assert sum(ref.rows(new.grad), []) == pytest.approx(sum(expected, []), rel=1e-5)


def test_reinforce_hand_computed_and_gradient():
    log_prob = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = compute_policy_loss_reinforce(
        old_log_prob=log_prob.detach() + 0.1, log_prob=log_prob, advantages=adv, response_mask=mask
    )
    assert loss.item() == pytest.approx((2 * 1 + 2 * 2 - 1 * 0.5) / 3)
    loss.backward()
    assert sum(ref.rows(log_prob.grad), []) == pytest.approx([-2 / 3, -2 / 3, 1 / 3, 0.0])
    assert metrics["ppo_kl"].item() == pytest.approx(0.1, rel=1e-5)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_global_batch_info_normalises_by_global_totals():
    loss, _ = losses_for(LOG_RATIO, clip_ratio=0.2)
    scaled, _ = losses_for(LOG_RATIO, clip_ratio=0.2, global_batch_info={"batch_num_tokens": 20})
    assert scaled.item() == pytest.approx(loss.item() * 5 / 20, rel=1e-6)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "reinforce"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_extreme_log_ratios_and_empty_masks_stay_finite(name, mode):
    old = torch.tensor([[-1e4, -0.1, -50.0], [-0.2, -3e3, -1.0]])
    new = torch.tensor([[-0.1, -1e4, -0.0], [-2e3, -0.1, -1.0]], requires_grad=True)
    adv = torch.tensor([[5.0, -5.0, 1.0], [-3.0, 3.0, 0.0]])
    for mask in (torch.ones(2, 3), torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]])):
        new.grad = None
        loss, metrics = get_policy_loss(name)(
            old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=mode, clip_ratio=0.2
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())


# -------------------------------------------------------------------------- properties
token_cases = dict(
    log_ratio=st.floats(-30, 30),
    advantage=st.floats(-10, 10),
    low=st.floats(0.0, 0.9),
    high=st.floats(0.0, 2.0),
    clip_c=st.floats(1.01, 10),
)


@settings(max_examples=80, deadline=None)
@given(**token_cases)
def test_clipping_never_raises_the_objective(log_ratio, advantage, low, high, clip_c):
    """Per token, the clipped objective -L <= the unclipped A * ratio, except where dual-clip caps
    the loss (A < 0, ratio > clip_ratio_c); there the loss is exactly -A * clip_ratio_c."""
    loss, _ = compute_policy_loss_vanilla(
        old_log_prob=torch.zeros(1, 1, dtype=torch.float64),
        log_prob=torch.full((1, 1), log_ratio, dtype=torch.float64),
        advantages=torch.full((1, 1), advantage, dtype=torch.float64),
        response_mask=torch.ones(1, 1), clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c,
    )
    loss = loss.item()
    ratio = math.exp(max(-20, min(20, log_ratio)))
    assert loss == pytest.approx(ref.ppo_token_loss(log_ratio, advantage, low, high, clip_c)[0], rel=1e-9, abs=1e-12)
    if advantage < 0 and ratio > clip_c:
        assert loss == pytest.approx(-advantage * clip_c, rel=1e-9)
    else:
        assert -loss <= advantage * ratio + 1e-9 * max(1.0, abs(advantage * ratio))
    if advantage < 0:
        assert loss <= -advantage * clip_c + 1e-9 * max(1.0, abs(advantage * clip_c))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=6), st.floats(-3, 3))
def test_gspo_clipping_never_raises_the_objective(deltas, advantage):
    n = len(deltas)
    old = torch.zeros(1, n, dtype=torch.float64)
    adv = torch.full((1, n), advantage, dtype=torch.float64)
    new = torch.tensor([deltas], dtype=torch.float64)
    clipped, _ = compute_policy_loss_gspo(old_log_prob=old, log_prob=new, advantages=adv,
                                          response_mask=torch.ones(1, n), clip_ratio=0.1)
    s = math.exp(min(sum(deltas) / n, 10.0))
    # seq-mean-token-mean divides by (tokens + 1e-8), as verl: hence the relative tolerance
    assert -clipped.item() <= advantage * s + 1e-7 * max(1.0, abs(advantage * s))
