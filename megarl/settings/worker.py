"""What one Megatron rank needs to build and run its models (``WorkerSettings``): built once by the driver
(``worker_settings``) and sent to every rank, so the ranks never read the config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.settings.engine import (actor_settings, critic_settings, hf_config_overrides, initial_checkpoints,
                                    layout_from_config, lora_settings, model_overrides, needs_reference,
                                    offload_flags, reference_settings)


@dataclass(frozen=True)
class RoleSettings:
    """How one model of a rank (actor, ref or critic) is built, started and checkpointed."""

    hf_path: str  # its HF checkpoint: the architecture, and the weights unless ``start`` is given
    start: str | None = None  # a megatron dist checkpoint it starts from (any layout)
    overrides: dict = field(default_factory=dict)  # megatron TransformerConfig fields (typed)
    hf_overrides: dict = field(default_factory=dict)  # HF config fields (<model>.override_config.model_config)
    lora: Any = None  # LoRASettings, or None
    adapter_path: str | None = None  # a PEFT adapter the LoRA model starts from
    save_contents: tuple[str, ...] = ("model", "optimizer", "extra")  # <role>.checkpoint.save_contents
    load_contents: tuple[str, ...] = ("model", "optimizer", "extra")  # <role>.checkpoint.load_contents
    freeze_vision_tower: bool = False  # actor.freeze_vision_tower (a vision-language model's tower keeps its weights)


@dataclass(frozen=True)
class WorkerSettings:
    layout: Any  # megarl.models.ParallelLayout (the actor's; the reference and critic share it)
    seed: int  # actor_rollout_ref.actor.megatron.seed: megatron's model-parallel RNG
    timeout_s: float  # actor_rollout_ref.nccl_timeout: the torch.distributed groups'
    actor: Any  # megarl.engine.ActorSettings
    actor_role: RoleSettings
    ref: Any = None  # megarl.engine.BatchSettings of the reference's log-prob pass, or None: no reference
    ref_role: RoleSettings | None = None
    critic: Any = None  # megarl.engine.CriticSettings, or None: no critic
    critic_role: RoleSettings | None = None
    offload: dict = field(default_factory=dict)  # "<model>.<params|grads|optimizer>" -> offloaded between phases
    profiler: Any = None  # megarl.settings.profiling.ProfilerSettings, or None: no profiling

    def role(self, name: str) -> RoleSettings:
        return {"actor": self.actor_role, "ref": self.ref_role, "critic": self.critic_role}[name]


def worker_settings(cfg, world_size: int):
    """What every Megatron rank of a ``world_size``-rank trainer builds and runs (``MegatronWorker.setup``)."""
    from megarl.models import model_dims
    from megarl.settings.derived import critic_enabled
    from megarl.settings.profiling import profiler_settings

    arr = cfg.actor_rollout_ref
    path = arr.model.path
    layout = layout_from_config(arr.actor.megatron, model_dims(path).num_layers)
    dp_size = world_size // layout.replica_ranks
    start = initial_checkpoints(cfg)

    def role(name: str, hf_path: str, section, lora_section) -> RoleSettings:
        lora = lora_settings(cfg, name)
        checkpoint = section.checkpoint if name != "ref" else None
        return RoleSettings(
            hf_path=str(hf_path), start=start[name], overrides=model_overrides(cfg, name),
            hf_overrides=hf_config_overrides(cfg, name), lora=lora,
            adapter_path=(lora_section.adapter_path or None) if lora is not None else None,
            save_contents=tuple(checkpoint.save_contents) if checkpoint is not None else (),
            load_contents=tuple(checkpoint.load_contents) if checkpoint is not None else (),
            freeze_vision_tower=name == "actor" and bool(arr.actor.freeze_vision_tower))

    with_critic = critic_enabled(cfg)
    return WorkerSettings(
        layout=layout, seed=int(arr.actor.megatron.seed), timeout_s=float(arr.nccl_timeout),
        actor=actor_settings(cfg, dp_size), actor_role=role("actor", path, arr.actor, arr.model.lora),
        ref=reference_settings(cfg) if needs_reference(cfg) else None,
        ref_role=role("ref", path, arr.ref, None) if needs_reference(cfg) else None,
        critic=critic_settings(cfg, dp_size) if with_critic else None,
        critic_role=role("critic", cfg.critic.model.path, cfg.critic, cfg.critic.model.lora) if with_critic else None,
        offload=offload_flags(cfg), profiler=profiler_settings(cfg))
