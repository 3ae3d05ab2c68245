"""Entropy from logits and the clipped value loss."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import _algo_reference as ref
from megarl.algorithms import LOSS_AGG_MODES, compute_entropy_loss, compute_value_loss, entropy_from_logits


def test_entropy_hand_computed():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -float("inf"), -float("inf")]])
    # uniform over 4: log 4; p = (3/4, 1/4): -(3/4 log 3/4 + 1/4 log 1/4)
    expected = [math.log(4), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]
    assert entropy_from_logits(logits).tolist() == pytest.approx(expected, rel=1e-6)


def test_entropy_matches_reference_for_extreme_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 50, generator=gen) * torch.tensor([1.0, 100.0, 1e4]).view(1, 3, 1)
    logits[1, 0, :10] = -float("inf")
    logits.requires_grad_(True)
    entropy = entropy_from_logits(logits)
    expected = [[ref.entropy(row) for row in seq] for seq in logits.detach().tolist()]
    assert sum(ref.rows(entropy.reshape(-1, 1).T), []) == pytest.approx(sum(expected, []), rel=1e-4, abs=1e-5)
    entropy.sum().backward()
    assert torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=20))
def test_entropy_is_between_zero_and_log_vocab(row):
    h = entropy_from_logits(torch.tensor(row, dtype=torch.float64)).item()
    assert -1e-9 <= h <= math.log(len(row)) + 1e-9


def test_entropy_loss_aggregates_over_response_tokens():
    logits = torch.zeros(2, 3, 8)
    logits[1, 1, 0] = 1e4  # a certain token: entropy 0
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss = compute_entropy_loss(logits, mask, "token-mean")
    assert loss.item() == pytest.approx(4 * math.log(8) / 5, rel=1e-5)


def test_value_loss_hand_computed():
    vpreds = torch.tensor([[1.0, 2.0, 50.0]])
    values = torch.tensor([[0.0, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # token 0: clip(1) to [-0.5, 0.5] = 0.5 -> max((1-2)^2, (0.5-2)^2) = 2.25 (clipped term wins)
    # token 1: within range -> (2-0)^2 = 4 both; not counted as clipped
    assert loss.item() == pytest.approx(0.5 * (2.25 + 4.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_loop(mode):
    gen = torch.Generator().manual_seed(1)
    vpreds, values, returns = (torch.randn(4, 6, generator=gen) for _ in range(3))
    mask = (torch.rand(4, 6, generator=gen) > 0.3).long()
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2, loss_agg_mode=mode)
    token, clipped = [], []
    for vp, v, r, m in zip(ref.rows(vpreds), ref.rows(values), ref.rows(returns), ref.rows(mask)):
        row = []
        for p, old, target, mm in zip(vp, v, r, m):
            pc = max(old - 0.2, min(old + 0.2, p))
            row.append(max((p - target) ** 2, (pc - target) ** 2))
            if mm:
                clipped.append((pc - target) ** 2 > (p - target) ** 2)
        token.append(row)
    assert loss.item() == pytest.approx(0.5 * ref.aggregate(token, ref.rows(mask), mode), rel=1e-5)
    assert clipfrac.item() == pytest.approx(sum(clipped) / len(clipped), abs=1e-6)


def test_value_loss_empty_mask_is_zero():
    loss, clipfrac = compute_value_loss(torch.ones(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), 0.5)
    assert loss.item() == 0.0 and clipfrac.item() == 0.0
