"""Registries: helpful errors, decorator registration, and the uniform keyword call."""

import numpy as np
import pytest
import torch

import megarl.algorithms as algos
from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    get_adv_estimator,
    get_policy_loss,
    register_adv_estimator,
    register_policy_loss,
)


def test_registered_names_are_verls():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
        "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "spin", "sppo",  # spin, sppo: verl's recipes
    }
    # verl's core_algos registry (August 2026) less bypass_mode (megarl: algorithm.rollout_correction.bypass_mode)
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "reinforce", "gpg", "dppo_tv", "dppo_kl", "sapo", "clip_cov",
                                  "kl_cov", "geo_mean", "dro", "cispo", "sppo"}  # gpg: verl's name for reinforce
    assert POLICY_LOSSES["gpg"] is POLICY_LOSSES["reinforce"]
    assert set(KL_PENALTIES) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert LOSS_AGG_MODES == ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize(
    "lookup, config_key, known",
    [
        (lambda: get_adv_estimator("grpoo"), "algorithm.adv_estimator", "gae, gpg, grpo, grpo_passk"),
        (lambda: get_policy_loss("ppo"), "actor_rollout_ref.actor.policy_loss.loss_mode", "cispo, clip_cov, dppo_kl"),
        (lambda: algos.kl_penalty(torch.zeros(1), torch.zeros(1), "k4"), "kl_loss_type", "abs, k1, k2, k3, kl"),
        (lambda: algos.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean"), "loss_agg_mode", "token-mean, token-sum, seq-mean-token-sum"),
        (lambda: algos.get_kl_controller(**{"type": "pid", "kl_coef": 0.1}), "kl_ctrl.type", "adaptive, fixed"),
    ],
)
def test_unknown_name_lists_known_names(lookup, config_key, known):
    with pytest.raises(ValueError) as info:
        lookup()
    message = str(info.value)
    assert config_key in message and known in message


def test_unknown_name_error_is_key_and_value_error():
    with pytest.raises(KeyError):
        ADVANTAGE_ESTIMATORS["nope"]
    assert issubclass(UnknownNameError, ValueError)
    assert "nope" not in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS.get("nope") is None


def test_decorator_registers_new_estimator_and_loss():
    @register_adv_estimator("test_constant_one")
    def constant_one(token_level_rewards, response_mask):
        adv = torch.ones_like(token_level_rewards) * response_mask
        return adv, adv

    @register_policy_loss("test_zero_loss")
    def zero_loss(log_prob, response_mask):
        return (log_prob * 0).sum(), {}

    try:
        rewards, mask = torch.zeros(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]])
        # The trainer's uniform call: extra shared inputs are dropped for this estimator.
        adv, _ = get_adv_estimator("test_constant_one")(
            token_level_rewards=rewards, response_mask=mask, index=np.array(["a", "b"]), values=None, gamma=1.0, lam=0.95
        )
        assert adv.tolist() == [[1, 1, 0], [1, 0, 0]]
        loss, metrics = get_policy_loss("test_zero_loss")(
            old_log_prob=rewards, log_prob=rewards, advantages=rewards, response_mask=mask, clip_ratio=0.2
        )
        assert float(loss) == 0 and metrics == {}
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_constant_one")
        POLICY_LOSSES.unregister("test_zero_loss")
    assert "test_constant_one" not in ADVANTAGE_ESTIMATORS


def test_registering_a_taken_name_with_another_function_fails():
    registry = Registry("widget", "widgets.kind")

    @registry.register("a")
    def first():
        return 1

    registry.register("a")(first)  # the same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(lambda: 2)
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("")


def test_uniform_call_errors_name_the_problem():
    estimator = get_adv_estimator("gae")
    rewards = torch.zeros(1, 2)
    with pytest.raises(TypeError, match=r"needs \['gamma', 'lam', 'values'\]"):
        estimator(token_level_rewards=rewards, response_mask=torch.ones(1, 2))
    with pytest.raises(TypeError, match="unexpected argument.*'lamda'"):
        estimator(token_level_rewards=rewards, response_mask=torch.ones(1, 2), values=rewards, gamma=1.0, lam=1.0, lamda=0.9)
    with pytest.raises(ValueError, match="gae needs critic"):
        estimator(token_level_rewards=rewards, response_mask=torch.ones(1, 2), values=None, gamma=1.0, lam=1.0)


def test_function_with_var_kwargs_receives_everything():
    registry = Registry("widget", "widgets.kind")
    registry.register("anything")(lambda **kwargs: kwargs)
    call = algos.UniformCall("widget", "anything", registry["anything"], frozenset())
    assert call(a=1, b=2) == {"a": 1, "b": 2}
