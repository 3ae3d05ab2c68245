"""The trainer/rollout mismatch under megarl's names and verl's (``megarl.algorithms.mismatch``)."""
from __future__ import annotations

import pytest
import torch

from megarl.algorithms.mismatch import probs_diff_sums, rollout_mismatch_metrics, verl_probs_diff


def _batch():
    generator = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(4, 6, generator=generator) * 3
    rollout = log_probs + 0.05 * torch.randn(4, 6, generator=generator)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return log_probs, rollout, mask


def test_verls_names_are_verls_probability_differences():
    """verl (ray_trainer): |exp(rollout) - exp(actor)| over the response mask, its max, mean and torch.std."""
    log_probs, rollout, mask = _batch()
    metrics = rollout_mismatch_metrics(log_probs, rollout, mask)
    verl = torch.masked_select((rollout.exp() - log_probs.exp()).abs(), mask.bool())
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(float(verl.max()))
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(float(verl.mean()))
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(float(verl.std()))
    megarl = torch.masked_select((rollout - log_probs).abs(), mask.bool())
    assert metrics["rollout/logprob_diff"] == pytest.approx(float(megarl.mean()))
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(float(megarl.max()))


def test_micro_batch_sums_give_the_same_metrics():
    """The update's probe sums over micro-batches (here two halves of the batch) and finishes with the token count."""
    log_probs, rollout, mask = _batch()
    parts = [probs_diff_sums(log_probs[i:i + 2], rollout[i:i + 2], mask[i:i + 2]) for i in (0, 2)]
    tokens = float(mask.sum())
    mean = sum(float(p["probs_diff"]) for p in parts) / tokens
    mean_sq = sum(float(p["probs_diff_sq"]) for p in parts) / tokens
    largest = max(float(p["probs_diff_max"]) for p in parts)
    whole = rollout_mismatch_metrics(log_probs, rollout, mask)
    for name, value in verl_probs_diff(mean, mean_sq, largest, tokens).items():
        assert value == pytest.approx(whole[name], rel=1e-5), name
