"""verl's newer policy losses (DPPO, CISPO, SAPO, GMPO, DRO, Clip-Cov, KL-Cov) against loop references.

The references (``_loss_reference``) follow the papers' formulas and verl's ``core_algos``
definitions token by token; the gradients are checked too where a loss detaches part of itself
(the importance weight of DPPO and CISPO, the random cut of Clip-Cov).
"""

import math

import pytest
import torch

from megarl.algorithms import get_policy_loss
from tests.algorithms import _algo_reference as ref
from tests.algorithms import _loss_reference as lref

MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]])


def batch(seed, spread=0.3, rows=4, cols=6):
    """Old log-probs of likely and unlikely tokens, a perturbed new policy, mixed-sign advantages."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(rows, cols, generator=gen) * 0.98 + 0.01)
    new = (old + torch.randn(rows, cols, generator=gen) * spread).clamp(max=-1e-3)
    adv = torch.randn(rows, cols, generator=gen)
    return old, new.requires_grad_(), adv


def call(name, old, new, adv, mask=MASK, **options):
    return get_policy_loss(name)(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, **options)


def masked_fraction(values, mask):
    picked = [v for vr, mr in zip(values, ref.rows(mask)) for v, m in zip(vr, mr) if m]
    return sum(picked) / len(picked)


def grad_of(loss, new):
    (grad,) = torch.autograd.grad(loss, new)
    return grad


@pytest.mark.parametrize("name, kind", [("dppo_tv", "tv"), ("dppo_kl", "kl")])
@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean"])
def test_dppo_matches_loop_reference(name, kind, mode):
    old, new, adv = batch(0, spread=0.6)
    low, high, cap = 0.05, 0.08, 1.5
    loss, metrics = call(name, old, new, adv, loss_agg_mode=mode, clip_ratio=0.2, clip_ratio_low=low,
                         clip_ratio_high=high, clip_ratio_c=cap)
    token_loss, token_grad, valid, capped = lref.dppo(ref.rows(old), ref.rows(new), ref.rows(adv), kind, low, high, cap)
    assert 0 < masked_fraction(valid, MASK) < 1 and masked_fraction(capped, MASK) > 0  # the batch exercises both
    assert loss.item() == pytest.approx(ref.aggregate(token_loss, ref.rows(MASK), mode), rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 - masked_fraction(valid, MASK), abs=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(masked_fraction(capped, MASK), abs=1e-6)
    # the truncated weight is detached: the gradient is -A * min(r, c) * valid, aggregated like the loss
    expected = torch.tensor(token_grad) * MASK
    scale = {"token-mean": 1 / MASK.sum(), "token-sum": 1.0}.get(mode)
    if scale is not None:
        assert torch.allclose(grad_of(loss, new), expected * scale, atol=1e-6)


def test_dppo_kl_and_tv_mask_different_tokens():
    """TV bounds the probability's move; binary KL lets a rare token move further and a likely one less."""
    old = torch.log(torch.tensor([[0.01, 0.9]]))
    new = torch.log(torch.tensor([[0.12, 0.999]])).requires_grad_()  # TV: 0.11, 0.099; binary KL: 0.092, 0.367
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    options = dict(clip_ratio=0.1, clip_ratio_c=100.0, loss_agg_mode="token-sum")
    tv_loss, tv = call("dppo_tv", old, new, adv, mask, **options)
    kl_loss, kl = call("dppo_kl", old, new, adv, mask, **options)
    assert tv["pg_clipfrac"].item() == kl["pg_clipfrac"].item() == pytest.approx(0.5)
    tv_grad, kl_grad = grad_of(tv_loss, new)[0].tolist(), grad_of(kl_loss, new)[0].tolist()
    assert tv_grad[0] == 0.0 != tv_grad[1]  # TV masks the rare token
    assert kl_grad[1] == 0.0 != kl_grad[0]  # binary KL masks the likely one
    # a falling probability is never masked for a positive advantage (it moves against the push)
    _, falling = call("dppo_kl", new.detach(), old, adv, mask, **options)
    assert falling["pg_clipfrac"].item() == 0.0


def test_dppo_refuses_a_non_positive_weight_cap():
    old, new, adv = batch(1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        call("dppo_tv", old, new, adv, clip_ratio_c=0.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_cispo_matches_loop_reference_and_never_drops_a_gradient(mode):
    old, new, adv = batch(2, spread=0.4)
    low, high = 0.1, 0.2
    loss, metrics = call("cispo", old, new, adv, loss_agg_mode=mode, clip_ratio_low=low, clip_ratio_high=high)
    token_loss, token_grad, clipped = lref.cispo(ref.rows(old), ref.rows(new), ref.rows(adv), low, high)
    assert loss.item() == pytest.approx(ref.aggregate(token_loss, ref.rows(MASK), mode), rel=1e-5)
    assert 0 < metrics["pg_clipfrac"].item() == pytest.approx(masked_fraction(clipped, MASK), abs=1e-6)
    if mode == "token-mean":
        grad = grad_of(loss, new)
        assert torch.allclose(grad, torch.tensor(token_grad) * MASK / MASK.sum(), atol=1e-6)
        assert (grad[MASK.bool()] != 0).all()  # unlike PPO's clip, no valid token loses its gradient


@pytest.mark.parametrize("mode", [None, "token-mean"])
def test_sapo_matches_loop_reference(mode):
    old, new, adv = batch(3)
    options = {} if mode is None else {"loss_agg_mode": mode}
    loss, metrics = call("sapo", old, new, adv, tau_pos=1.0, tau_neg=2.0, **options)
    token_loss = lref.sapo(ref.rows(old), ref.rows(new), ref.rows(adv), 1.0, 2.0)
    expected = ref.aggregate(token_loss, ref.rows(MASK), mode or "seq-mean-token-mean")  # verl's: seq-mean-token-mean
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["ppo_kl"].item() == pytest.approx(masked_fraction(ref.rows(old - new.detach()), MASK), rel=1e-5)


def test_sapo_gradient_at_ratio_one_is_the_policy_gradient():
    """The gate's slope at r = 1 is 1 whatever tau: the first step equals REINFORCE's (and PPO's)."""
    old, _, adv = batch(4)
    new = old.clone().requires_grad_()
    loss, _ = call("sapo", old, new, adv, loss_agg_mode="token-sum", tau_pos=0.5, tau_neg=3.0)
    assert torch.allclose(grad_of(loss, new), -adv * MASK, atol=1e-6)
    with pytest.raises(ValueError, match="tau_neg"):
        call("sapo", old, new, adv, tau_pos=1.0, tau_neg=0.0)


def test_geo_mean_matches_loop_reference():
    old, new, adv = batch(5, spread=0.5)
    adv[:, 0] = 0.0  # a zero advantage keeps its log-ratio out of the product (sign 0)
    loss, metrics = call("geo_mean", old, new, adv, clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3)
    expected, up, down = lref.geo_mean(ref.rows(old), ref.rows(new), ref.rows(adv), ref.rows(MASK), 0.1, 0.3)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert up > 0 and down > 0
    assert metrics["pg_clipfrac"].item() == pytest.approx(up / MASK.sum().item(), abs=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(down / MASK.sum().item(), abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum"])
def test_dro_matches_loop_reference(mode):
    old, new, adv = batch(6)
    loss, _ = call("dro", old, new, adv, loss_agg_mode=mode, dro_beta=0.7)
    expected = ref.aggregate(lref.dro(ref.rows(old), ref.rows(new), ref.rows(adv), 0.7), ref.rows(MASK), mode)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="dro_beta"):
        call("dro", old, new, adv)  # verl's default is None: the key must be set


def test_kl_cov_matches_loop_reference():
    old, new, adv = batch(7)
    loss, metrics = call("kl_cov", old, new, adv, kl_cov_ratio=0.2, ppo_kl_coef=0.5)
    token_loss, chosen = lref.kl_cov(ref.rows(old), ref.rows(new), ref.rows(adv), ref.rows(MASK), 0.2, 0.5)
    assert len(chosen) == int(0.2 * MASK.sum().item())
    assert loss.item() == pytest.approx(ref.aggregate(token_loss, ref.rows(MASK), "token-mean"), rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(len(chosen) / MASK.sum().item())
    assert metrics["ppo_kl"].item() == pytest.approx(masked_fraction(ref.rows((new - old).abs()), MASK), rel=1e-5)


def test_clip_cov_cuts_only_high_covariance_unclipped_tokens():
    old, new, adv = batch(8, spread=0.4)
    low = high = 0.2
    ppo, _ = call("vanilla", old, new, adv, clip_ratio=0.2, clip_ratio_c=1e9)  # no dual clip
    a, lp = adv[MASK.bool()], new.detach()[MASK.bool()]
    cov = torch.zeros_like(adv)
    cov[MASK.bool()] = (a - a.mean()) * (lp - lp.mean())
    ratio = torch.exp(new.detach() - old)
    unclipped = ~(-adv * ratio.clamp(1 - low, 1 + high) > -adv * ratio)
    lb, ub = 0.0, 5.0
    candidates = MASK.bool() & unclipped & (cov > lb) & (cov < ub)
    assert candidates.sum() >= 3
    # a ratio that asks for every candidate: the cut is deterministic, the loss is PPO's without them
    loss, metrics = call("clip_cov", old, new, adv, clip_ratio=0.2, clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    ppo_tokens = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    assert loss.item() == pytest.approx((ppo_tokens * MASK * ~candidates).sum().item() / MASK.sum().item(), rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(candidates.sum().item() / MASK.sum().item())
    # one token: a random candidate, whose gradient alone is cut
    torch.manual_seed(0)
    loss, metrics = call("clip_cov", old, new, adv, clip_ratio=0.2, clip_cov_ratio=1e-3, clip_cov_lb=lb, clip_cov_ub=ub)
    ppo_grad, cut_grad = grad_of(ppo, new), grad_of(loss, new)
    cut = MASK.bool() & (cut_grad == 0) & (ppo_grad != 0)
    assert cut.sum() == 1 and candidates[cut].all()
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / MASK.sum().item())
    assert math.isclose(grad_of(call("clip_cov", old, new, adv, clip_ratio=0.2, clip_cov_ratio=1e-3,
                                     clip_cov_lb=100.0, clip_cov_ub=200.0)[0], new).sub(ppo_grad).abs().max().item(),
                        0.0, abs_tol=1e-7)  # no candidate in the window: PPO's gradient
