"""The start-up line that says which memory features each trained role is built with (``memory_line``)."""
from __future__ import annotations

from megarl.checks import load_config
from megarl.run.startup_lines import memory_line

BASE = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m"]
OVERRIDES = "megatron.override_transformer_config"


def test_recompute_and_the_other_memory_features_are_shown_as_the_engine_resolves_them():
    assert memory_line(load_config("quickstart", BASE)) == "memory: actor no recompute, distributed optimizer, packed sequences"
    shorthand = load_config("quickstart", [*BASE, "actor_rollout_ref.model.enable_gradient_checkpointing=True"])
    assert memory_line(shorthand).startswith("memory: actor full recompute (uniform, 1 layer per unit), ")
    both = load_config(None, [
        *BASE, "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", f"actor_rollout_ref.actor.{OVERRIDES}.recompute_granularity=selective",
        f"critic.{OVERRIDES}.recompute_granularity=full", f"critic.{OVERRIDES}.recompute_method=block",
        f"critic.{OVERRIDES}.recompute_num_layers=2", "actor_rollout_ref.actor.megatron.param_offload=True",
        "actor_rollout_ref.actor.megatron.optimizer_offload=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096", "actor_rollout_ref.model.lora.rank=8",
        "critic.megatron.use_remove_padding=False"])
    actor, critic = memory_line(both).removeprefix("memory: ").split("; ")
    assert actor == ("actor selective recompute (core_attn), param/optimizer offload, distributed optimizer, packed "
                     "sequences, token-budget micro-batches, LoRA rank 8 (frozen base)")
    assert critic == (
        "critic full recompute (block: 2 layer(s) per pipeline stage), distributed optimizer, token-budget micro-batches")
