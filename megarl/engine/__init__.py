"""The Megatron engine: log-probs, entropy, values, the actor/critic updates and distributed checkpoints.

Every rank of a megatron-core job builds its model chunks (``megarl.models.build_model``) and
wraps them here:

    actor = MegatronActor(build_model(path, layout, "actor"), actor_settings(cfg, dp_size))  # megarl.settings.engine
    old_log_probs, entropy = actor.compute_log_prob(batch, with_entropy=True)
    metrics = actor.update_policy(batch.with_fields(old_log_probs=old_log_probs, advantages=...))

Modules, one concept each:
  batch          RLBatch: the padded RL batch (left-padded prompt + right-padded response)
  batching       mini-batches, fixed and token-budget micro-batches, restoring the order
  packing        model inputs: packed rows (THD, CP chunks) or padded rows; the response positions
  vocab_parallel log-probs and entropy over a TP-split vocabulary
  schedule       megatron's pipeline schedule (forward_backward_func) and stage-to-stage sharing
  runner         ModelRunner: micro-batching + packing + schedule, results on every rank
  settings       the engine's settings and how verl's config keys map onto them
  optimizer      mcore DDP, megatron's optimizer and LR schedule, the non-finite-skipping step
  overrides      verl's override_transformer_config / override_optimizer_config onto megatron's configs
  offload        weights, grads and optimizer state to host memory between phases, and back
  update         the mini-batch / optimizer-step loop and the loss scaling it relies on
  actor, critic, reference   the three roles
  checkpoint     dist_checkpointing save/load with resharding and atomic writes
  checkpoint_dirs  where checkpoints are and what each holds (no tensor read)
  manifest       every checkpoint file's size and SHA-256, recorded at save, checked at load
  unpickling     checkpoint reads unpickle only what the format needs (no code runs)
  disk_space     room for a checkpoint, checked before a save and named when one runs out
"""
from megarl.engine.actor import MegatronActor
from megarl.engine.batch import PER_TOKEN_FIELDS, RLBatch, concat_multi_modal_inputs, data_parallel_shard
from megarl.engine.batching import (balanced_partitions, fixed_micro_batches, mini_batches, restore_order,
                                   token_budget_micro_batches)
from megarl.engine.checkpoint import (checkpoint_contents, checkpoint_dir, checkpoint_extra, checkpoint_problems,
                                     checkpoint_tensors, latest_checkpoint, load_checkpoint, resolve_checkpoint,
                                     save_checkpoint, step_directories)
from megarl.engine.disk_space import CheckpointSpaceError
from megarl.engine.manifest import CheckpointIntegrityError, integrity_error, verify_checkpoint
from megarl.engine.unpickling import UnsafeCheckpointError
from megarl.engine.critic import MegatronCritic
from megarl.engine.reference import BaseModelReference, MegatronReference
from megarl.engine.settings import ActorSettings, BatchSettings, CriticSettings, OptimizerSettings, PolicyLossSettings

__all__ = [
    "ActorSettings",
    "BaseModelReference",
    "BatchSettings",
    "CheckpointIntegrityError",
    "CheckpointSpaceError",
    "CriticSettings",
    "MegatronActor",
    "MegatronCritic",
    "MegatronReference",
    "OptimizerSettings",
    "PER_TOKEN_FIELDS",
    "PolicyLossSettings",
    "RLBatch",
    "concat_multi_modal_inputs",
    "UnsafeCheckpointError",
    "balanced_partitions",
    "checkpoint_contents",
    "checkpoint_dir",
    "checkpoint_extra",
    "checkpoint_problems",
    "checkpoint_tensors",
    "data_parallel_shard",
    "fixed_micro_batches",
    "integrity_error",
    "latest_checkpoint",
    "load_checkpoint",
    "mini_batches",
    "resolve_checkpoint",
    "restore_order",
    "save_checkpoint",
    "step_directories",
    "token_budget_micro_batches",
    "verify_checkpoint",
]
