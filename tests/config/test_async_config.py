"""Asynchronous training and rollout correction keys: verl's spellings, megarl's settings, the refusals."""
from __future__ import annotations

import pytest

from megarl.checks import ConfigError, load_config
from megarl.settings.cluster import plan_from_config
from megarl.settings.trainer import async_settings

VALID = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
         "trainer.n_gpus_per_node=2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
SPLIT = ["trainer.placement=split", "trainer.rollout_gpus=1"]
TIS = ["algorithm.rollout_correction.rollout_is=token"]


def cfg(*overrides):
    return load_config(None, [*VALID, *overrides])


def messages(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*VALID, *overrides])
    return "\n".join(p.message for p in info.value.problems)


def test_verls_separate_async_with_a_rollout_pool_is_fully_async_on_split_pools():
    c = cfg("+trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=2",
            "trainer.v1.sampler.max_off_policy_strategy=drop", "trainer.v1.separate_async.parameter_sync_step=2",
            "rollout.nnodes=1", "rollout.n_gpus_per_node=2", "async_training.use_rollout_log_probs=true")
    assert (c.async_training.mode, c.trainer.placement) == ("fully_async", "split")
    assert c.algorithm.rollout_correction.bypass_mode is True  # use_rollout_log_probs is bypass mode
    settings = async_settings(c)
    assert (settings.bound.threshold, settings.bound.sync_every, settings.bound.strategy) == (2.0, 2, "drop")
    assert settings.in_flight == "wait" and settings.off_policy
    plan = plan_from_config(c)  # the trainer's 1 x 2 devices, then the rollout pool's 1 x 2
    assert (plan.nnodes, plan.trainer, plan.replicas) == (2, (0, 1), ((2,), (3,)))


def test_hybrid_engine_and_colocate_async():
    assert cfg("actor_rollout_ref.hybrid_engine=true").trainer.placement == "colocated"  # verl's default: nothing
    assert cfg("actor_rollout_ref.hybrid_engine=false", "trainer.rollout_gpus=1").trainer.placement == "split"
    c = cfg("+trainer.v1.trainer_mode=colocate_async", "async_training.partial_rollout=true", *TIS)
    assert (c.async_training.mode, c.trainer.placement) == ("fully_async", "colocated")
    assert async_settings(c).in_flight == "abort"  # partial rollouts: a sync aborts, then resumes
    assert async_settings(cfg()) is None


def test_verls_fully_async_form_train_batch_size_zero():
    c = cfg("data.train_batch_size=0", "async_training.mode=fully_async", "async_training.require_batches=2", *SPLIT, *TIS)
    assert c.data.train_batch_size == 4 and async_settings(c).bound.batch_groups == 4
    assert "require_batches x ppo_mini_batch_size = 6 prompts, but data.train_batch_size=4" in messages(
        "async_training.mode=fully_async", "async_training.require_batches=3", *SPLIT, *TIS)


def test_off_policy_needs_a_correction_naming_the_keys():
    from megarl.settings.trainer import async_settings
    text = messages("async_training.mode=one_step_off", *SPLIT)
    assert "no correction is chosen: set algorithm.rollout_correction.rollout_is" in text and "bypass_mode=True" in text
    assert "no correction" in messages("async_training.mode=fully_async", "async_training.staleness_threshold=0.5", *SPLIT)
    assert "no correction" in messages("async_training.mode=fully_async", "async_training.staleness_threshold=0",
                                       "async_training.trigger_parameter_sync_step=2", *SPLIT)
    on_policy = cfg("async_training.mode=fully_async", "async_training.staleness_threshold=0", *SPLIT)
    assert not async_settings(on_policy).off_policy  # staleness 0, a sync every step: on-policy
    for correction in (TIS, ["algorithm.rollout_correction.rollout_rs=geometric",
                             "algorithm.rollout_correction.rollout_rs_threshold=1.001"],
                       ["algorithm.rollout_correction.bypass_mode=true"]):
        cfg("async_training.mode=one_step_off", *SPLIT, *correction)


def test_combinations_that_cannot_work_are_refused():
    assert "one_step_off overlaps generation with training, which colocated GPUs cannot" in messages(
        "async_training.mode=one_step_off", *TIS)
    assert ("async_training.staleness_threshold=0.5 set, but async_training.mode=sync"
            in messages("async_training.staleness_threshold=0.5"))
    assert "one_step_off is staleness 1" in messages("async_training.mode=one_step_off", "async_training.partial_rollout=true",
                                                     *SPLIT, *TIS)
    assert "trainer.critic_warmup=2 with async_training.mode=fully_async" in messages(
        "async_training.mode=fully_async", "trainer.critic_warmup=2", *SPLIT, *TIS)
    assert "ReMax's greedy baselines" in messages("async_training.mode=fully_async", "algorithm.adv_estimator=remax",
                                                  *SPLIT, *TIS)
    assert "trainer.v1.trainer_mode=hybrid: megarl maps the values 'sync', 'colocate_async', 'separate_async'" in messages(
        "+trainer.v1.trainer_mode=hybrid")
    assert "async_training.max_off_policy_strategy='later': use one of ('wait', 'drop')" in messages(
        "async_training.mode=fully_async", "async_training.max_off_policy_strategy=later", *SPLIT, *TIS)
    assert "rollout.n_gpus_per_node=4 differs from trainer.n_gpus_per_node=2" in messages(
        "rollout.nnodes=1", "rollout.n_gpus_per_node=4")
    assert cfg("+trainer.v1.trainer_mode=separate_async", "trainer.rollout_gpus=1", *TIS).trainer.placement == "split"
    assert "means async_training.mode=fully_async, but async_training.mode=one_step_off is given" in messages(
        "+trainer.v1.trainer_mode=separate_async", "async_training.mode=one_step_off", *SPLIT, *TIS)
    assert "set algorithm.rollout_correction.bypass_mode=False" in messages("+async_training.compute_prox_log_prob=true")


def test_rollout_correction_checks():
    assert "rollout_is='tokens': use null or one of" in messages("algorithm.rollout_correction.rollout_is=tokens")
    assert "needs algorithm.rollout_correction.rollout_rs_threshold" in messages("algorithm.rollout_correction.rollout_rs=token")
    assert "would count the correction twice" in messages(*TIS, "algorithm.rollout_correction.bypass_mode=true")
    assert "loss_type=reinforce is bypass mode's loss" in messages("algorithm.rollout_correction.loss_type=reinforce")
    assert "loss_mode=gspo" in messages("algorithm.rollout_correction.bypass_mode=true",
                                        "algorithm.rollout_correction.loss_type=reinforce",
                                        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    c = cfg("actor_rollout_ref.actor.use_rollout_log_probs=true")  # verl's actor-side spelling of bypass mode
    assert c.algorithm.rollout_correction.bypass_mode is True


def test_log_probs_mode_raw_is_refused_where_it_is_not_the_sampled_distribution():
    assert "logprobs_mode=raw_logprobs reports log-probs before temperature" in messages(
        "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "actor_rollout_ref.rollout.temperature=0.7")
    cfg("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs")  # T=1, no top-k/top-p: the same numbers
    assert cfg().actor_rollout_ref.rollout.logprobs_mode == "processed_logprobs"
