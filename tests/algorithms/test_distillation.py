"""The distillation losses equal a direct computation on a fixed batch; bad settings are refused by name."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.distillation import DistillationLossSettings, distillation_loss, distillation_token_losses

STUDENT = torch.tensor([[-0.5, -2.0, -1.0, -3.0], [-0.1, -4.0, -0.7, -9.0]])
TEACHER = torch.tensor([[-1.5, -0.2, -0.5, -0.3], [-0.1, -0.5, -6.0, -0.1]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)


def by_hand(mode: str, s: float, t: float) -> float:
    d = s - t
    return {"k1": d, "abs": abs(d), "k2": 0.5 * d * d,
            "k3": max(-10.0, min(10.0, math.exp(max(-20.0, min(20.0, -d))) - 1 + d))}[mode]


@pytest.mark.parametrize("mode", ["k1", "abs", "k2", "k3"])
def test_token_losses_are_the_estimators_of_the_student_teacher_gap(mode):
    losses = distillation_token_losses(STUDENT, TEACHER, DistillationLossSettings(loss_mode=mode,
                                                                                  use_policy_gradient=mode == "k1"))
    for i in range(2):
        for j in range(4):
            assert losses[i, j].item() == pytest.approx(by_hand(mode, STUDENT[i, j].item(), TEACHER[i, j].item()),
                                                        rel=1e-5, abs=1e-6)


def test_the_direct_loss_is_the_token_mean_and_its_gradient_follows_the_teacher():
    student = STUDENT.clone().requires_grad_(True)
    settings = DistillationLossSettings(loss_mode="k3", loss_max_clamp=2.0)
    loss, metrics = distillation_loss(student, student.detach(), TEACHER, MASK, settings)
    expected = [min(2.0, by_hand("k3", s, t)) for s, t, m in
                zip(STUDENT.flatten().tolist(), TEACHER.flatten().tolist(), MASK.flatten().tolist()) if m]
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert metrics["token_loss"].item() == pytest.approx(loss.item(), rel=1e-5)
    loss.backward()
    # d k3 / d s = 1 - exp(t - s): down where the teacher is less sure than the student, up where more
    assert student.grad[0, 0] > 0 and student.grad[0, 2] < 0
    assert student.grad[0, 3] == 0  # padding
    assert student.grad[1, 1] == 0  # clamped at 2.0: no gradient through the bound


def test_as_a_reward_it_is_ppo_clip_with_minus_the_loss_as_advantage():
    from megarl.algorithms import get_policy_loss

    student = STUDENT.clone().requires_grad_(True)
    old = STUDENT - 0.05
    settings = DistillationLossSettings(loss_mode="k1", use_policy_gradient=True, clip_ratio_low=0.1,
                                        clip_ratio_high=0.3)
    loss, metrics = distillation_loss(student, old, TEACHER, MASK, settings)
    reference, _ = get_policy_loss("vanilla")(old_log_prob=old, log_prob=STUDENT.clone().requires_grad_(True),
                                              advantages=-(STUDENT - TEACHER), response_mask=MASK, clip_ratio=0.1,
                                              clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert set(metrics) == {"token_loss", "pg_clipfrac", "ppo_kl"}


def test_the_coefficient_counts_only_beside_the_task_rewards():
    assert DistillationLossSettings(distillation_loss_coef=0.3).coef == 0.3
    assert DistillationLossSettings(distillation_loss_coef=0.3, use_task_rewards=False).coef == 1.0


@pytest.mark.parametrize("kwargs, words", [
    (dict(loss_mode="k1"), "does not depend on the teacher"),
    (dict(loss_mode="forward_kl_topk", topk=0), "at least one teacher token"),
    (dict(loss_mode="k3", log_prob_min_clamp=-5.0), "top-k losses only"),
    (dict(loss_mode="k7"), "is not a distillation loss"),
    (dict(loss_max_clamp=0.0), "must be > 0"),
])
def test_bad_settings_are_refused_with_the_key(kwargs, words):
    with pytest.raises(ValueError, match=words) as raised:
        DistillationLossSettings(**kwargs)
    assert "distillation.distillation_loss" in str(raised.value)


def test_forward_kl_topk_is_the_teachers_top_k_forward_kl_with_clamps_and_masses():
    """sum over the teacher's top-k of p_T (log p_T - log p_S), not renormalised; clamps from below first."""
    generator = torch.Generator().manual_seed(3)
    teacher = torch.log_softmax(torch.randn(2, 3, 6, generator=generator), -1)[..., :4]  # top-4 of 6: mass < 1
    student = torch.log_softmax(torch.randn(2, 3, 6, generator=generator), -1)[..., :4].requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    settings = DistillationLossSettings(loss_mode="forward_kl_topk", topk=4)
    loss, metrics = distillation_loss(student.sum(-1), student.sum(-1).detach(), None, mask, settings, "token-mean",
                                      student_topk=student, teacher_topk=teacher)
    by_hand = torch.zeros(2, 3)
    for b in range(2):
        for r in range(3):
            by_hand[b, r] = sum(teacher[b, r, v].exp() * (teacher[b, r, v] - student[b, r, v]) for v in range(4))
    assert loss.item() == pytest.approx((by_hand * mask).sum().item() / 5, rel=1e-6)
    assert metrics["teacher_mass"].item() == pytest.approx((teacher.exp().sum(-1) * mask).sum().item() / 5, rel=1e-6)
    assert metrics["student_mass"].item() == pytest.approx((student.exp().sum(-1) * mask).sum().item() / 5, rel=1e-6)
    assert 0 < metrics["teacher_mass"].item() < 1
    loss.backward()  # the gradient raises the student's log-prob of each top-k token by p_T / tokens
    expected = (teacher.exp() / 5) * mask.unsqueeze(-1)
    assert torch.allclose(-student.grad, expected, atol=1e-7)
    clamped = DistillationLossSettings(loss_mode="forward_kl_topk", topk=4, log_prob_min_clamp=-1.0)
    low, _ = distillation_loss(student.sum(-1), student.sum(-1), None, mask, clamped, student_topk=student,
                               teacher_topk=teacher)
    t, s_ = teacher.clamp_min(-1.0), student.detach().clamp_min(-1.0)
    assert low.item() == pytest.approx(((t.exp() * (t - s_)).sum(-1) * mask).sum().item() / 5, rel=1e-6)
    with pytest.raises(ValueError, match="needs the student's and the teacher's top-k"):
        distillation_loss(student.sum(-1), student.sum(-1), None, mask, settings)
