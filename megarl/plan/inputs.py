"""What a plan reads from a run's config, through the same functions the trainer uses.

The layout comes from ``megatron_worker.layout_from_config``, the placement of every rank and
replica from ``placement.plan_from_config``, the batch settings from the engine's
``actor_settings`` / ``reference_settings`` / ``critic_settings``, recompute from the engine's
``model_overrides`` (so ``model.enable_gradient_checkpointing`` means what it means to the
engine), the offload groups from ``offload_phases.offload_flags``. Nothing is read twice.

Lengths are planned at their worst: every response as long as ``rollout.response_length``,
every prompt as long as ``rollout.prompt_length`` (``rollout.max_model_len`` caps both).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.models.layout import ParallelLayout
from megarl.plan.activations import MicroBatch, Recompute
from megarl.plan.model import ModelFacts

if TYPE_CHECKING:
    from megarl.engine.settings import BatchSettings


@dataclass(frozen=True)
class RoleInputs:
    """One Megatron model of the run (actor, reference or critic)."""

    name: str  # actor | ref | critic
    model: ModelFacts
    train: BatchSettings | None  # None: forward only (the reference)
    forward: BatchSettings  # log-prob / value passes
    recompute: Recompute
    distributed_optimizer: bool = True
    entropy_grad: bool = False  # the actor's entropy bonus needs the entropy's gradient
    epochs: int = 1


@dataclass(frozen=True)
class RolloutInputs:
    tp: int
    replicas: int
    gpu_memory_utilization: float
    sleeps: bool  # free_cache_engine on a colocated placement: the engines sleep while the trainer works
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_length: int
    response_length: int
    max_model_len: int | None
    bucket_bytes: int
    sync_mode: str  # shard | full
    prefix_caching: bool = True  # the n samples of a prompt share one prefill

    @property
    def sequence_length(self) -> int:
        length = self.prompt_length + self.response_length
        return min(length, self.max_model_len) if self.max_model_len else length


@dataclass(frozen=True)
class RunInputs:
    layout: ParallelLayout
    cp: int
    trainer_world: int
    placement: object  # megarl.cluster.placement.PlacementPlan
    roles: tuple[RoleInputs, ...]
    offload: dict  # "<model>.<params|grads|optimizer>" -> on
    rollout: RolloutInputs
    prompts_per_step: int
    samples_per_prompt: int
    param_itemsize: int = 2  # bf16 weights on GPU
    kernel: str = "transformer_engine"  # the layer spec megarl builds on a GPU with Transformer Engine

    @property
    def dp(self) -> int:
        return self.trainer_world // (self.layout.tp * self.layout.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.trainer_world // (self.layout.pp * self.layout.ep * self.layout.etp)

    def role(self, name: str) -> RoleInputs | None:
        return next((r for r in self.roles if r.name == name), None)

    @property
    def sequence_length(self) -> int:
        return self.rollout.sequence_length

    def micro_batch(self, settings: BatchSettings) -> MicroBatch:
        """The largest micro-batch ``settings`` makes of full-length samples."""
        seq = self.sequence_length
        if settings.use_dynamic_bsz:  # the budget is per device: a CP group's micro-batch holds CP x it
            rows = max(1, settings.max_token_len * self.cp // seq)
        else:
            rows = settings.micro_batch_size
        return MicroBatch(rows, seq, min(self.rollout.response_length, seq))

    def micro_batches(self, settings: BatchSettings, samples: int) -> int:
        """Micro-batches of ``samples`` full-length samples on one rank."""
        rows = self.micro_batch(settings).rows
        return max(1, -(-samples // rows))

    @property
    def samples_per_rank(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt // self.dp


def _model(path: str, key: str) -> ModelFacts:
    import logging

    from megarl.models.locate import resolve_model_path
    from megarl.models.published import PUBLISHED, match_published

    local = resolve_model_path(str(path))
    if local is None:
        local = match_published(str(path))  # e.g. /models/Llama-3.1-70B-Instruct on a laptop
        if local is None:
            known = ", ".join(sorted(p.name for p in PUBLISHED.iterdir() if (p / "config.json").is_file()))
            raise ValueError(f"{key}={path}: no such model directory, and not one of the published configs megarl "
                             f"carries ({known}); the plan reads only config.json: point {key} at a directory "
                             "holding it")
        logging.getLogger("megarl.plan").info("%s=%s is not on this machine: planning with the published "
                                              "config.json of %s", key, path, local.name)
    return _facts(str(Path(local).resolve()))


@lru_cache(maxsize=8)
def _facts(directory: str) -> ModelFacts:
    """One ``ModelFacts`` per model directory and process (its counts are cached inside)."""
    from megarl.models.dims import load_hf_config

    return ModelFacts(load_hf_config(directory))


def run_inputs(cfg) -> RunInputs:
    """The plan's inputs from a loaded, validated megarl config."""
    from megarl.settings.derived import critic_enabled
    from megarl.engine.settings import actor_settings, critic_settings, model_overrides, reference_settings
    from megarl.settings.engine import layout_from_config, needs_reference
    from megarl.engine.offload_phases import offload_flags
    from megarl.cluster.placement import plan_from_config

    arr = cfg.actor_rollout_ref
    actor_model = _model(arr.model.path, "actor_rollout_ref.model.path")
    megatron = arr.actor.megatron
    layout = layout_from_config(megatron, actor_model.dims.num_layers)
    placement = plan_from_config(cfg)
    world, cp = placement.trainer_world, layout.cp
    if world % (layout.tp * layout.pp * cp) or (world // layout.pp) % (layout.ep * layout.etp):
        raise ValueError(f"{world} trainer GPUs do not split into TP{layout.tp} x PP{layout.pp} x CP{cp} "
                         f"(and EP{layout.ep} x ETP{layout.etp} per stage)")
    dp = world // (layout.tp * layout.pp * cp)
    actor = actor_settings(cfg, dp)
    roles = [RoleInputs("actor", actor_model, actor.train, actor.log_prob,
                        Recompute.from_overrides(model_overrides(cfg, "actor", typed=False)), actor.optim.use_distributed_optimizer,
                        actor.loss.entropy_coeff != 0, actor.train.epochs)]
    if needs_reference(cfg):
        roles.append(RoleInputs("ref", actor_model, None, reference_settings(cfg),
                                Recompute.from_overrides(model_overrides(cfg, "ref", typed=False))))
    if critic_enabled(cfg):
        path = cfg.critic.model.path
        critic_model = actor_model if path == arr.model.path else _model(path, "critic.model.path")
        critic = critic_settings(cfg, dp)
        roles.append(RoleInputs("critic", critic_model, critic.train, critic.values,
                                Recompute.from_overrides(model_overrides(cfg, "critic", typed=False)),
                                critic.optim.use_distributed_optimizer, False, critic.train.epochs))
    r = arr.rollout
    rollout = RolloutInputs(
        tp=r.tensor_model_parallel_size, replicas=len(placement.replicas),
        gpu_memory_utilization=r.gpu_memory_utilization,
        sleeps=bool(r.free_cache_engine) and placement.mode == "colocated",
        max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
        prompt_length=r.prompt_length, response_length=r.response_length, max_model_len=r.max_model_len,
        bucket_bytes=r.weight_sync.bucket_mb << 20, sync_mode="shard", prefix_caching=bool(r.enable_prefix_caching))
    return RunInputs(layout, cp, world, placement, tuple(roles), offload_flags(cfg), rollout,
                     cfg.data.train_batch_size, r.n)
