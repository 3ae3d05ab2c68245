"""SPIN and SPPO end to end on the quickstart task: the same loop as GRPO (Megatron actor, Ray), with the
``hf`` rollout backend (these claims are the trainer's; vLLM's start would double the tests' time).

SPIN's reference takes the actor's weights at the start of every ``trainer.ref_update_freq``-th
step: with 2 and three steps, the reference equals the policy that sampled at steps 1 (the initial
model) and 2 (refreshed), and lags one update behind at step 3, which DPO's logged numbers show.
"""
from __future__ import annotations

import math

import pytest

from megarl.checks import load_config
from tests.trainer.test_e2e import HF_ROLLOUT, overrides, scalars

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]

ACTOR = "actor_rollout_ref.actor"
SHORT = ["trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.test_freq=-1",
         "trainer.val_before_train=false", HF_ROLLOUT]


def per_step(logged, name):
    return [value for _, value in sorted(logged[name])]


@pytest.mark.timeout(900)
def test_spin_refreshes_its_reference_and_logs_dpo(quickstart_inputs, tmp_path):
    from megarl.run.train import run

    out = tmp_path / "spin"
    cfg = load_config("quickstart", overrides(
        quickstart_inputs, out, "algorithm.adv_estimator=spin", "actor_rollout_ref.rollout.n=2",
        f"{ACTOR}.policy_loss.loss_mode=reinforce", f"{ACTOR}.loss_agg_mode=token-sum",
        f"{ACTOR}.ppo_mini_batch_size=16", f"{ACTOR}.optim.lr=1e-4", f"{ACTOR}.dpo_beta=0.1",
        "trainer.ref_update_freq=2", *SHORT))
    run(cfg)
    logged = scalars(out)
    assert len(per_step(logged, "actor/pg_loss")) == 3
    policy, reference = per_step(logged, "actor/policy_chosen_logps"), per_step(logged, "actor/reference_chosen_logps")
    gaps = [abs(p - r) for p, r in zip(policy, reference)]
    assert gaps[0] < 1e-3 and gaps[1] < 1e-3, gaps  # step 1: both the initial model; step 2: refreshed
    assert gaps[2] > 10 * max(gaps[:2]) and gaps[2] > 1e-3, gaps  # step 3: the reference is one update behind
    losses = per_step(logged, "actor/dpo_loss")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)  # margin 0 at the start: -log sigmoid(0)


@pytest.mark.timeout(900)
def test_sppo_trains_with_its_loss(quickstart_inputs, tmp_path):
    from megarl.run.train import run

    out = tmp_path / "sppo"
    cfg = load_config("quickstart", overrides(
        quickstart_inputs, out, "algorithm.adv_estimator=sppo", f"{ACTOR}.policy_loss.loss_mode=sppo",
        f"{ACTOR}.loss_agg_mode=token-mean", "algorithm.sppo_eta=1.0", f"{ACTOR}.sppo_eta=1.0", *SHORT))
    run(cfg)
    logged = scalars(out)
    losses = per_step(logged, "actor/pg_loss")
    assert len(losses) == 3 and all(math.isfinite(v) and v >= 0 for v in losses)  # a mean of squares
    assert any(v > 0 for v in per_step(logged, "actor/grad_norm"))
