"""The controller's pieces for SPIN and SPPO: the estimator's inputs from the config, the reference's refresh."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.algorithms import compute_spin_outcome_advantage, soft_mean
from megarl.checks import load_config
from megarl.settings.trainer import trainer_settings
from megarl.trainer.advantage_step import compute_advantages
from megarl.trainer.controller import RLTrainer

ACTOR = "actor_rollout_ref.actor"
BASE = ["data.train_files=x.parquet", "actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", f"{ACTOR}.ppo_mini_batch_size=2",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
UID = ["p0", "p0", "p1", "p1"]


def rewards(scores):
    out = torch.zeros(MASK.shape)
    out[torch.arange(4), MASK.sum(-1) - 1] = torch.tensor(scores)
    return out


def test_spin_advantages_read_the_configs_dpo_keys_and_the_step_log_probs():
    cfg = load_config(None, [*BASE, "algorithm.adv_estimator=spin", f"{ACTOR}.policy_loss.loss_mode=reinforce",
                             f"{ACTOR}.loss_agg_mode=token-sum", f"{ACTOR}.dpo_beta=0.3", "algorithm.dpo_loss_type=ipo"])
    old, ref = -torch.rand(4, 3, generator=torch.Generator().manual_seed(0)), -torch.rand(4, 3)
    metrics: dict = {}
    settings = trainer_settings(cfg)
    adv, ret = compute_advantages(settings.algorithm, rewards([1.0, 0.0, 0.0, 2.0]), MASK, UID, old_log_probs=old,
                                  ref_log_probs=ref, metrics=metrics, dpo_beta=settings.dpo_beta)
    expected, _, direct = compute_spin_outcome_advantage(
        token_level_rewards=rewards([1.0, 0.0, 0.0, 2.0]), response_mask=MASK, index=UID, old_log_prob=old,
        ref_log_prob=ref, dpo_beta=0.3, dpo_loss_type="ipo")
    assert torch.equal(adv, expected) and torch.equal(ret, expected)
    assert metrics == direct and "actor/dpo_loss" in metrics


def test_sppo_advantages_centre_by_the_configs_soft_mean():
    cfg = load_config(None, [*BASE, "algorithm.adv_estimator=sppo", f"{ACTOR}.policy_loss.loss_mode=sppo",
                             "algorithm.sppo_eta=2.0"])
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0])
    adv, _ = compute_advantages(trainer_settings(cfg).algorithm, rewards(scores.tolist()), MASK, UID)
    assert torch.allclose(adv, (scores - soft_mean(scores, 2.0)).unsqueeze(-1) * MASK)


@pytest.mark.parametrize("freq, resumed, due", [(-1, False, []), (1, False, [1, 2, 3, 4, 5, 6]),
                                                (3, False, [3, 6]), (3, True, [1, 3, 6])])
def test_reference_refresh_every_k_steps_and_after_a_resume(freq, resumed, due):
    trainer = SimpleNamespace(settings=SimpleNamespace(trainer=SimpleNamespace(ref_update_freq=freq)),
                              refresh_after_resume=resumed)
    assert [step for step in range(1, 7) if RLTrainer._reference_refresh_due(trainer, step)] == due
