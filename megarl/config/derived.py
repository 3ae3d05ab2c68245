"""What a config implies, read from its keys alone: used by the components and by the checks.

Nothing here imports a component: the trainer, the planner and the checks (``megarl.checks``)
all read these answers from one place. Facts that need a component's registry (an estimator that
needs a critic) are in ``megarl.settings.derived``.
"""
from __future__ import annotations

from omegaconf import DictConfig

def devices_for(cfg: DictConfig) -> tuple[int, int]:
    """(trainer devices, rollout devices) for the configured placement."""
    nnodes, per_node, mode, rollout = cluster_shape(cfg)
    world = nnodes * per_node
    if mode == "split":
        return world - (rollout or 0), rollout or 0
    return world, world


def old_log_prob_pass(cfg: DictConfig) -> str | None:
    """Why a step runs the separate old-log-prob pass, or None when the update's own forward gives them.

    On-policy (one mini-batch, one epoch) the batch is used for exactly one optimizer step, so the
    old log-probs equal that step's forward (ratio 1, verl's and TRL's rule) and the pass is skipped,
    unless something needs them before the update or the user asks for it.
    """
    actor = cfg.actor_rollout_ref.actor
    if actor.recompute_old_log_prob:
        return "actor_rollout_ref.actor.recompute_old_log_prob=True"
    if actor.ppo_epochs != 1:
        return f"actor_rollout_ref.actor.ppo_epochs={actor.ppo_epochs}: several updates per batch"
    if actor.ppo_mini_batch_size < cfg.data.train_batch_size:
        return (f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} < data.train_batch_size="
                f"{cfg.data.train_batch_size}: several updates per batch")
    if cfg.algorithm.use_kl_in_reward:
        return "algorithm.use_kl_in_reward: the reward's KL penalty needs them before the update"
    c = cfg.algorithm.rollout_correction
    if not c.bypass_mode and (c.rollout_is or c.rollout_rs or c.rollout_token_veto_threshold):
        return "algorithm.rollout_correction: its importance weights pi_old / pi_rollout need them before the update"
    dropout = {k: v for k, v in dict(actor.megatron.override_transformer_config or {}).items()
               if k in ("hidden_dropout", "attention_dropout") and v}
    if dropout:
        return f"dropout in actor_rollout_ref.actor.megatron.override_transformer_config ({dropout}): the update's forward differs from the rollout policy's"
    return None


def cluster_shape(cfg) -> tuple[int, int, str, int | None]:
    """(nodes, devices per node, placement mode, rollout devices) of a config.

    megarl's form: ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` devices in all, ``trainer.placement``
    and (split) ``trainer.rollout_gpus`` of them for the fleet. verl's form of split pools (its
    one-step-off and fully-async recipes): the trainer's ``trainer.nnodes`` x ``n_gpus_per_node`` plus
    a rollout pool of ``rollout.nnodes`` x ``rollout.n_gpus_per_node``; the nodes must be alike.
    """
    t, pool = cfg.trainer, cfg.rollout
    if not pool.nnodes:
        return t.nnodes, t.n_gpus_per_node, t.placement, t.rollout_gpus
    if pool.n_gpus_per_node != t.n_gpus_per_node:
        raise ValueError(f"rollout.n_gpus_per_node={pool.n_gpus_per_node} differs from trainer.n_gpus_per_node="
                         f"{t.n_gpus_per_node}: megarl places the trainer and the rollout pool on alike nodes; give "
                         "both the same count")
    rollout = pool.nnodes * pool.n_gpus_per_node
    if t.rollout_gpus is not None and t.rollout_gpus != rollout:
        raise ValueError(f"trainer.rollout_gpus={t.rollout_gpus} but the rollout pool rollout.nnodes x "
                         f"rollout.n_gpus_per_node is {rollout}; give one of them")
    return t.nnodes + pool.nnodes, t.n_gpus_per_node, "split", rollout


def derive_async_keys(cfg, notes: list[str]) -> None:
    """verl's fully-async form sets ``data.train_batch_size=0``: a step is then ``async_training.require_batches``
    PPO mini-batches (of ``ppo_mini_batch_size`` prompts)."""
    a, data = cfg.async_training, cfg.data
    if a.mode != "sync" and data.train_batch_size == 0:
        data.train_batch_size = a.require_batches * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        notes.append(f"data.train_batch_size=0 (verl's fully-async form): a step trains async_training.require_batches"
                     f" x ppo_mini_batch_size = {data.train_batch_size} prompts")
