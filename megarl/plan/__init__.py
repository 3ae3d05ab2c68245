"""``megarl plan``: memory and time of a run, per GPU and per phase, before anything starts.

Pure arithmetic from the model's HF config and the run's config (no process, no GPU, no tensor):

    from megarl.plan import plan_config
    plan = plan_config(cfg, gpu("h100"))          # a RunPlan: memory, times, what does not fit
    print(render(plan))                           # megarl.plan.report

One module per concern: ``model`` (counts from the bridge's shard layout), ``buffers``
(megatron's DDP and distributed-optimizer bytes), ``activations``, ``rollout`` (vLLM weights
and KV cache), ``memory`` (per role and phase), ``sync`` (link bytes of a weight sync),
``timing``, ``hardware`` (the GPU table), ``check`` (what does not fit, and the keys that fix
it; config validation uses it), ``packing`` (the tokens sequence packing saves on a length
distribution), ``report`` (text and JSON), ``command`` (the CLI).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.plan.hardware import Efficiency, Hardware, gpu
from megarl.plan.inputs import RunInputs, run_inputs
from megarl.plan.memory import MemoryPlan, memory_plan
from megarl.plan.timing import TimePlan, time_plan

__all__ = ["Efficiency", "Finding", "Hardware", "RunPlan", "gpu", "plan_config", "plan_run", "run_inputs"]


@dataclass(frozen=True)
class Finding:
    """Something that does not fit: where, by how much, and the single key changes that make it fit."""

    where: str  # a phase, or "vLLM KV cache"
    message: str
    fixes: tuple[str, ...] = ()  # "key=value" changes, each alone makes the run fit
    helps: tuple[str, ...] = ()  # changes that shrink the problem but do not solve it alone
    together: tuple[str, ...] = ()  # when no change alone does: changes that make it fit together


@dataclass
class RunPlan:
    inputs: RunInputs
    hardware: Hardware
    efficiency: Efficiency
    memory: MemoryPlan
    time: TimePlan
    findings: list[Finding] = field(default_factory=list)
    packing: list | None = None  # megarl.plan.packing.PassPacking per pass, with a response-length median
    response_median: int | None = None

    @property
    def fits(self) -> bool:
        return not self.findings


def plan_run(inputs: RunInputs, hardware: Hardware, efficiency: Efficiency = Efficiency()) -> RunPlan:
    """Memory and times of ``inputs`` on ``hardware`` (findings without suggested keys)."""
    from megarl.plan.check import fit_findings

    memory = memory_plan(inputs, hardware, efficiency)
    plan = RunPlan(inputs, hardware, efficiency, memory, time_plan(inputs, memory, hardware, efficiency))
    plan.findings = fit_findings(plan)
    return plan


def plan_config(cfg, hardware: Hardware, efficiency: Efficiency = Efficiency(), suggest: bool = True,
                response_median: int | None = None) -> RunPlan:
    """The plan of a loaded megarl config; with ``suggest``, each finding names the keys that fix it; with
    ``response_median``, what sequence packing saves at that median response length (``packing``)."""
    plan = plan_run(run_inputs(cfg), hardware, efficiency)
    if suggest and plan.findings:
        from megarl.plan.check import with_fixes

        plan.findings = with_fixes(cfg, plan)
    if response_median is not None:
        from megarl.plan.packing import packing_plan

        plan.packing, plan.response_median = packing_plan(plan.inputs, response_median), response_median
    return plan
