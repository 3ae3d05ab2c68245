"""KL estimators, KL controllers, the in-reward penalty and the KL loss."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import _algo_reference as ref
from megarl.algorithms import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)


def test_estimators_hand_computed():
    logp = torch.tensor([-1.0, -2.0])
    ref_logp = torch.tensor([-1.5, -1.0])  # d = logp - ref = 0.5, -1
    expected = {
        "kl": [0.5, -1.0],
        "abs": [0.5, 1.0],
        "mse": [0.125, 0.5],
        "low_var_kl": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1],
    }
    aliases = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
    for name in KL_PENALTIES:
        values = kl_penalty(logp, ref_logp, name).tolist()
        assert values == pytest.approx(expected[aliases.get(name, name)], rel=1e-6), name


@pytest.mark.parametrize("name", sorted(KL_PENALTIES))
def test_estimators_match_loop_reference_including_extremes(name):
    logp = torch.tensor([[-0.3, -1e4, -0.0, -50.0, -3.0], [-200.0, -0.1, -7.0, -7.0, -1e-6]])
    ref_logp = torch.tensor([[-0.2, -0.1, -1e4, -2.0, -3.5], [-0.1, -300.0, -7.0, -6.0, -2e-6]])
    values = kl_penalty(logp, ref_logp, name)
    expected = [[ref.kl_estimate(a, b, name) for a, b in zip(ra, rb)] for ra, rb in zip(ref.rows(logp), ref.rows(ref_logp))]
    assert torch.isfinite(values).all()
    assert sum(ref.rows(values), []) == pytest.approx(sum(expected, []), rel=1e-5, abs=1e-6)


def test_k3_is_clamped_like_verl():
    logp = torch.tensor([0.0, 0.0])
    ref_logp = torch.tensor([100.0, -100.0])  # log ratio clamped to +-20, then k3 to 10
    assert kl_penalty(logp, ref_logp, "k3").tolist() == [10.0, 10.0]


@settings(max_examples=100, deadline=None)
@given(st.floats(-1e4, 0.0), st.floats(-1e4, 0.0), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_k3_is_never_negative(logp, ref_logp, dtype):
    value = kl_penalty(torch.tensor([logp], dtype=dtype), torch.tensor([ref_logp], dtype=dtype), "k3")
    assert value.item() >= 0.0


@settings(max_examples=50, deadline=None)
@given(st.floats(-60, 0.0), st.floats(-60, 0.0))
def test_abs_and_k2_are_non_negative_and_k1_is_antisymmetric(a, b):
    x, y = torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64)
    assert kl_penalty(x, y, "abs").item() >= 0 and kl_penalty(x, y, "k2").item() >= 0
    assert kl_penalty(x, y, "k1").item() == -kl_penalty(y, x, "k1").item()


def test_kl_gradient_of_k3_is_finite_at_extremes():
    logp = torch.tensor([-1e4, 0.0, -5.0], requires_grad=True)
    kl_penalty(logp, torch.tensor([0.0, -1e4, -5.0]), "k3").sum().backward()
    assert torch.isfinite(logp.grad).all()


# ----------------------------------------------------------------------- controllers
def test_adaptive_controller_hand_computed():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    ctrl.update(current_kl=0.1, n_steps=100)  # error clip(2 - 1) = 0.2 -> x 1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.04, n_steps=100)  # error clip(-0.2) -> x 0.98
    assert ctrl.value == pytest.approx(0.102 * 0.98)
    ctrl.update(current_kl=0.05, n_steps=100)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.102 * 0.98)
    restored = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_controller_and_factory():
    fixed = FixedKLController(kl_coef=0.3)
    fixed.update(current_kl=9.0, n_steps=100)
    assert fixed.value == 0.3
    ctrl = get_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=500)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.2 and ctrl.horizon == 500
    assert isinstance(get_kl_controller(**{"type": "fixed", "kl_coef": 0.01}), FixedKLController)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        get_kl_controller(**{"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.1, "horizon": 0})
    with pytest.raises(ValueError, match="kl_ctrl.target_kl is not set"):
        get_kl_controller(**{"type": "adaptive", "kl_coef": 0.2, "horizon": 10})


# --------------------------------------------------------------------- penalty & loss
@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "abs"])
def test_apply_kl_penalty_matches_loop(kind):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 5, generator=gen)
    old = -torch.rand(4, 5, generator=gen) * 3
    refl = -torch.rand(4, 5, generator=gen) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    old[0, 4] = float("nan")  # padding may hold anything
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.01, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, old, refl, mask, ctrl, kl_penalty=kind)

    per_seq, expected = [], []
    for s_row, o_row, r_row, m_row in zip(ref.rows(scores), ref.rows(old), ref.rows(refl), ref.rows(mask)):
        kls = [ref.kl_estimate(o, r, kind) if m else 0.0 for o, r, m in zip(o_row, r_row, m_row)]
        expected.append([s - 0.2 * k for s, k in zip(s_row, kls)])
        n = sum(m_row)
        per_seq.append(sum(kls) / n if n else 0.0)
    current_kl = sum(per_seq) / len(per_seq)
    assert sum(ref.rows(rewards), []) == pytest.approx(sum(expected, []), rel=1e-5)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2  # the beta that was applied
    error = max(-0.2, min(0.2, current_kl / 0.01 - 1))
    assert ctrl.value == pytest.approx(0.2 * (1 + error * 4 / 100), rel=1e-6)


def test_kl_loss_matches_loop_and_has_gradient():
    log_prob = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -9.0]], requires_grad=True)
    ref_log_prob = torch.tensor([[-1.2, -1.5, -3.0], [-0.4, -0.9, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss = compute_kl_loss(log_prob, ref_log_prob, mask, kl_loss_type="low_var_kl", loss_agg_mode="seq-mean-token-mean")
    token = [[ref.kl_estimate(a, b, "k3") for a, b in zip(ra, rb)] for ra, rb in zip(ref.rows(log_prob), ref.rows(ref_log_prob))]
    assert loss.item() == pytest.approx(ref.aggregate(token, ref.rows(mask), "seq-mean-token-mean"), rel=1e-5)
    loss.backward()
    assert log_prob.grad[1, 2].item() == 0.0 and log_prob.grad[0, 0].item() != 0.0
