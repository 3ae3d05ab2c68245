"""How verl's config keys become the engine's settings (no processes, no megatron)."""
import pytest

from megarl.checks import load_config
from megarl.engine import OptimizerSettings
from megarl.settings.engine import actor_settings, critic_settings, reference_settings

BASE = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=8"]


def config(*overrides):
    return load_config("quickstart", [*BASE, *overrides], validate=False)


def test_mini_batches_are_counted_in_samples_per_data_parallel_rank():
    settings = actor_settings(config("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"), dp_size=2)
    assert settings.train.mini_batch_size == 4 * 8 // 2
    assert settings.train.micro_batch_size == 2
    with pytest.raises(ValueError, match="do not split"):
        actor_settings(config(), dp_size=3)


def test_grad_clip_wins_over_optim_clip_grad():
    settings = actor_settings(config("actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=2.0"), 1)
    assert settings.optim.clip_grad == 0.5


def test_lr_schedule_keys():
    settings = actor_settings(
        config(
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
            "actor_rollout_ref.actor.optim.total_training_steps=50",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
        ),
        1,
    )
    optim = settings.optim
    assert (optim.lr_warmup_steps, optim.lr_decay_style, optim.total_training_steps) == (5, "cosine", 50)
    assert optim.min_lr == pytest.approx(1e-4)
    explicit = actor_settings(config("actor_rollout_ref.actor.optim.lr_warmup_steps=3"), 1)
    assert explicit.optim.lr_warmup_steps == 3
    with pytest.raises(ValueError, match="total_training_steps"):
        OptimizerSettings(lr_decay_style="cosine")


def test_dynamic_batching_and_missing_micro_batch_sizes():
    dynamic = actor_settings(
        config("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"), 1
    )
    assert dynamic.train.use_dynamic_bsz and dynamic.train.max_token_len == 4096
    with pytest.raises(ValueError, match="critic.ppo_micro_batch_size_per_gpu"):
        critic_settings(config(), 1)
    critic = critic_settings(config("critic.ppo_micro_batch_size_per_gpu=4", "critic.cliprange_value=0.2"), 2)
    assert critic.train.mini_batch_size == 16 and critic.cliprange_value == 0.2
    assert reference_settings(config()).micro_batch_size == 64  # quickstart's ref.log_prob_micro_batch_size_per_gpu


def test_options():
    settings = actor_settings(
        config(
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.actor.megatron.optimizer_offload=true",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.rollout.temperature=0.7",
        ),
        1,
    )
    assert settings.optim.megatron_overrides == {}
    assert settings.loss.loss_mode == "gspo" and settings.loss.use_kl_loss
    assert settings.temperature == 0.7
