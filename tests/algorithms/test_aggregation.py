"""Masked reductions and loss aggregation against hand-computed values and plain loops."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms._algo_reference import aggregate, rows, whiten
from megarl.algorithms import LOSS_AGG_MODES, agg_loss, masked_mean, masked_var, masked_whiten

LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 200.0, 300.0], [6.0, 7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def test_agg_loss_hand_computed():
    # valid tokens: row 0 -> 1, 2, 3 (sum 6, mean 2); row 1 -> 4, 5 (sum 9, mean 4.5); row 2 empty.
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx(15 / 5)
    assert agg_loss(LOSS, MASK, "token-sum").item() == pytest.approx(15)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 4.5) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 9) / 2 / 4)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.75)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_loop(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 7, generator=gen)
    mask = (torch.rand(6, 7, generator=gen) > 0.4).long()
    mask[2] = 0  # one empty sequence
    assert agg_loss(loss, mask, mode).item() == pytest.approx(aggregate(rows(loss), rows(mask), mode), rel=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_gives_zero_loss_and_finite_gradient(mode):
    loss = torch.randn(3, 4, requires_grad=True)
    result = agg_loss(loss, torch.zeros(3, 4), mode)
    result.backward()
    assert result.item() == 0.0
    assert torch.isfinite(loss.grad).all()


def test_nan_in_padding_does_not_leak():
    loss = LOSS.clone()
    loss[0, 3] = float("nan")
    loss[2] = float("inf")
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(agg_loss(loss, MASK, mode))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_totals_add_up_to_the_full_batch(mode):
    """Gradient accumulation: each micro-batch normalised by the global totals sums to the full loss."""
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(8, 5, generator=gen)
    mask = (torch.rand(8, 5, generator=gen) > 0.3).long()
    mask[5] = 0
    full = agg_loss(loss, mask, mode)
    totals = {"batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(-1) > 0).sum()}
    parts = [agg_loss(loss[i:i + 2], mask[i:i + 2], mode, **totals) for i in range(0, 8, 2)]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-5)
    # With dp_size ranks whose gradients are averaged, each rank's loss is scaled by dp_size.
    dp = [agg_loss(loss[i:i + 4], mask[i:i + 4], mode, dp_size=2, **totals) for i in (0, 4)]
    assert (sum(dp) / 2).item() == pytest.approx(full.item(), rel=1e-5)


def test_dp_size_without_global_totals_is_an_error():
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="same shape"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")


def test_masked_mean_var_whiten_hand_computed():
    values = torch.tensor([[1.0, 3.0, 99.0], [5.0, 7.0, -99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(4.0)
    assert masked_mean(values, mask, axis=-1).tolist() == pytest.approx([2.0, 6.0])
    # unbiased variance of 1, 3, 5, 7 is 20/3
    assert masked_var(values, mask).item() == pytest.approx(20 / 3)
    white = masked_whiten(values, mask)
    assert white[mask.bool()].tolist() == pytest.approx([(v - 4) / math.sqrt(20 / 3) for v in (1, 3, 5, 7)], rel=1e-5)
    # verl transforms the padding positions too; the loop reference does the same.
    assert sum(rows(white), []) == pytest.approx(sum(whiten(rows(values), rows(mask)), []), rel=1e-5)


def test_whiten_with_fewer_than_two_tokens_is_zero_not_nan():
    values = torch.tensor([[2.0, 5.0]])
    assert masked_whiten(values, torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]
    assert masked_whiten(values, torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="at least 2 valid"):
        masked_var(values, torch.tensor([[1, 0]]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=3, max_size=12).filter(lambda v: max(v) - min(v) > 1e-2))
def test_whitened_values_have_zero_mean_unit_variance(values):
    t = torch.tensor([values], dtype=torch.float64)
    mask = torch.ones_like(t)
    white = masked_whiten(t, mask)
    assert white.mean().item() == pytest.approx(0.0, abs=1e-6)
    var = masked_var(t, mask).item()  # unit variance up to the 1e-8 that keeps rsqrt finite (verl's)
    assert white.std().item() == pytest.approx((var / (var + 1e-8)) ** 0.5, rel=1e-7)  # masked_mean: count + 1e-8
