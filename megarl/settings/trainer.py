"""What the controller receives (``TrainerSettings``, ``AsyncSettings``), built once from the config:
the ``trainer`` and ``algorithm`` sections typed, ``rollout.n``, ``response_length``,
``weight_sync.verify``, ``data.train_batch_size`` / ``val_batch_size`` / ``max_prompt_length``,
``async_training.*`` and what the config implies (critic, reference, greedy baselines, the
old-log-prob pass, devices, offload, where the actor starts)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.config.derived import devices_for
from megarl.settings import typed_config
from megarl.settings.derived import critic_enabled, greedy_baselines, old_log_prob_pass
from megarl.settings.engine import initial_checkpoints, needs_reference, offload_flags
from megarl.settings.profiling import profiler_settings
from megarl.algorithms.staleness import StalenessBound


def async_settings(cfg: Any) -> AsyncSettings | None:
    """None in ``sync`` mode; the config check has refused every combination that cannot work."""
    a = cfg.async_training
    if a.mode == "sync":
        return None
    batch = int(cfg.data.train_batch_size)
    if a.mode == "one_step_off":
        bound = StalenessBound(1.0, batch, 1, "wait", fifo=True)
        return AsyncSettings(a.mode, bound, "wait", float(a.wait_timeout_s))
    bound = StalenessBound(float(a.staleness_threshold), batch, int(a.trigger_parameter_sync_step),
                           str(a.max_off_policy_strategy))
    return AsyncSettings(a.mode, bound, "abort" if a.partial_rollout else "wait", float(a.wait_timeout_s))


def starts_from_adapter(cfg: Any) -> str | None:
    """What makes the actor's first weights differ from ``model.path`` through LoRA (None: nothing): an
    ``adapter_path``, or a non-zero initial B. The fleet must be synced before it generates."""
    lora = cfg.actor_rollout_ref.model.lora
    if lora.rank <= 0:
        return None
    if lora.adapter_path:
        return f"the LoRA adapter {lora.adapter_path}"
    if lora.lora_B_init_method != "zero":
        return f"LoRA adapters with lora_B_init_method={lora.lora_B_init_method}"
    return None


def trainer_settings(cfg: Any) -> TrainerSettings:
    from omegaconf import OmegaConf

    rollout = cfg.actor_rollout_ref.rollout
    use_critic = critic_enabled(cfg)
    lrs = {"actor": float(cfg.actor_rollout_ref.actor.optim.lr)}
    if use_critic:
        lrs["critic"] = float(cfg.critic.optim.lr)
    return TrainerSettings(
        trainer=typed_config(cfg.trainer), algorithm=typed_config(cfg.algorithm), n=int(rollout.n),
        response_length=int(rollout.response_length),
        max_prompt_length=int(cfg.data.max_prompt_length), train_batch_size=int(cfg.data.train_batch_size),
        val_batch_size=cfg.data.val_batch_size, verify_sync=bool(rollout.weight_sync.verify), use_critic=use_critic,
        needs_reference=needs_reference(cfg), dpo_beta=float(cfg.actor_rollout_ref.actor.dpo_beta),
        greedy_baselines=greedy_baselines(cfg),
        old_log_prob_pass=old_log_prob_pass(cfg), num_devices=devices_for(cfg)[0],
        trainer_offload=any(offload_flags(cfg).values()), asynchronous=async_settings(cfg), lrs=lrs,
        start_source=initial_checkpoints(cfg)["actor"] or starts_from_adapter(cfg), profiling=profiler_settings(cfg),
        config_record=OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else {})


@dataclass(frozen=True)
class AsyncSettings:
    mode: str
    bound: StalenessBound
    in_flight: str  # what a sync does to running generations: wait | abort (partial rollouts)
    timeout_s: float

    @property
    def off_policy(self) -> bool:
        """Some samples can train on weights newer than the ones that sampled them."""
        return self.bound.threshold > 0 or self.bound.sync_every > 1


@dataclass(frozen=True)
class TrainerSettings:
    trainer: Any  # the typed ``trainer`` section: frequencies, logging, checkpoints, resume, limits
    algorithm: Any  # the typed ``algorithm`` section: estimator, KL, filter groups, rollout correction
    n: int  # rollout.n: samples per prompt
    response_length: int  # rollout.response_length
    max_prompt_length: int  # data.max_prompt_length
    train_batch_size: int  # data.train_batch_size (prompts per step)
    val_batch_size: int | None = None  # data.val_batch_size (None: the whole validation set at once)
    verify_sync: bool = True  # rollout.weight_sync.verify: log the fleet/trainer log-prob gap every step
    use_critic: bool = False  # a critic trains (critic.enable, or the estimator needs values)
    needs_reference: bool = False  # a reference model runs (actor.use_kl_loss or algorithm.use_kl_in_reward)
    dpo_beta: float = 0.1  # actor_rollout_ref.actor.dpo_beta: SPIN's DPO beta (the estimator's)
    greedy_baselines: bool = False  # the estimator takes a greedy response per prompt as its baseline (ReMax)
    old_log_prob_pass: str | None = None  # why a separate old-log-prob pass runs (None: the update's own forward)
    num_devices: int = 1  # the trainer's devices (throughput per device)
    trainer_offload: bool = False  # some trainer state is offloaded between phases
    asynchronous: Any = None  # AsyncSettings, or None (sync mode)
    lrs: dict = field(default_factory=dict)  # role -> optim.lr, for the messages of a stopped run
    start_source: str | None = None  # what the actor starts from besides model.path (a checkpoint, an adapter)
    profiling: Any = None  # megarl.settings.profiling.ProfilerSettings: the profiled steps (None: off)
    config_record: dict = field(default_factory=dict)  # the whole config as plain data, kept in every checkpoint
