"""Device memory per GPU in every phase of a step, for each role, with offload and sleep/wake.

A colocated GPU holds one trainer rank and one vLLM worker. The trainer's state is the
offloadable groups of ``trainer/offload_phases.py`` (``<model>.params|grads|optimizer``): a group
is on the device in a phase when the phase needs it (``PHASES``) or its offload key is off. The
engines take ``gpu_memory_utilization`` of the GPU while they generate, sleep (weights dropped,
KV cache freed) while the trainer works when ``rollout.free_cache_engine`` is on, and wake their
weights (not the KV cache) for the sync (``trainer/rollout_memory.py``). With ``split`` placement
trainer and rollout GPUs are planned separately. Every pipeline stage is planned; a phase is as
large as its largest stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.plan.activations import Shape, chunk_bytes, forward_workspace, head_bytes, head_workspace, in_flight, rank_peak
from megarl.plan.buffers import frozen_bytes, trained_bytes
from megarl.plan.hardware import GB, Efficiency, Hardware
from megarl.plan.inputs import RoleInputs, RunInputs
from megarl.plan.rollout import EngineMemory, engine_memory
from megarl.engine.offload_phases import PHASES as NEEDS

# (display name, offload phase of offload_phases.PHASES, role it runs)
PHASES = (("generate", "rollout", None), ("log_prob", "log_prob", "actor"), ("ref", "ref", "ref"),
          ("values", "values", "critic"), ("update_critic", "update_critic", "critic"),
          ("update_actor", "update_actor", "actor"), ("sync", "sync", None))
KINDS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class RoleMemory:
    """One model on one rank of its largest stage: its state and its working memory."""

    role: str
    stage: int
    params: int
    grads: int = 0
    optimizer: int = 0
    activations: int = 0  # saved for backward at the update's peak (pipeline in flight included)
    logits: int = 0  # the update's transient around the loss (beyond what is saved)
    forward: int = 0  # transient of a forward-only pass (log-probs, values)

    def group(self, kind: str) -> int:
        return getattr(self, kind)


@dataclass
class PhaseMemory:
    phase: str
    gpu: str  # colocated | trainer | rollout
    items: list[tuple[str, int]] = field(default_factory=list)  # (what, bytes), largest stage

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)


@dataclass
class MemoryPlan:
    roles: dict[str, RoleMemory]
    stage_roles: dict[int, dict[str, RoleMemory]]  # every stage
    engine: EngineMemory
    phases: list[PhaseMemory]
    capacity: float
    sequences_per_replica: int  # sequences one replica generates per step

    def over(self) -> list[PhaseMemory]:
        return [p for p in self.phases if p.total > self.capacity]


def activation_bytes(model, layout, stage: int, mb, micro_batches: int, recompute, entropy_grad: bool,
                     critic: bool, itemsize: int, kernel: str, cp: int = 1, packed: bool = True) -> tuple[int, int]:
    """(saved activations at the update's peak, transient logits workspace) on one rank of ``stage``
    running ``micro_batches`` micro-batches shaped ``mb`` through the pipeline schedule."""
    shape = Shape(model.dims, layout.tp, layout.etp, layout.sequence_parallel, cp, itemsize, kernel, packed)
    vocab = layout.padded_vocab_size(model.dims.vocab_size)
    last = stage == layout.pp - 1
    units = in_flight(layout.pp, layout.vpp, stage, micro_batches)
    moe_layers = [[model.dims.is_moe_layer(i) for i in layout.chunk_layers(model.dims.num_layers, stage, c)]
                  for c in range(layout.vpp)]
    chunk = max((chunk_bytes(shape, mb, layers, recompute) for layers in moe_layers),
                key=lambda c: c.saved + c.recomputed)
    head = head_bytes(shape, mb, vocab, critic, entropy_grad) if last else 0
    workspace = head_workspace(shape, mb, vocab, critic) if last else 0
    return rank_peak(chunk, units, head), workspace


def role_memory(inputs: RunInputs, role: RoleInputs, stage: int) -> RoleMemory:
    """A role's bytes on one rank of pipeline ``stage`` (the largest data-parallel slice)."""
    layout, model = inputs.layout, role.model
    critic = role.name == "critic"
    params = model.stage_params(layout, stage, "critic" if critic else "actor")
    shape = Shape(model.dims, layout.tp, layout.etp, layout.sequence_parallel, inputs.cp, inputs.param_itemsize,
                  inputs.kernel, role.forward.use_remove_padding)
    vocab = layout.padded_vocab_size(model.dims.vocab_size)
    last = stage == layout.pp - 1
    forward = forward_workspace(shape, inputs.micro_batch(role.forward), vocab, logits=last and not critic,
                                entropy=role.name == "actor")
    if role.train is None:
        return RoleMemory(role.name, stage, frozen_bytes(params, inputs.param_itemsize), forward=forward)
    # the distributed optimizer shards dense state over data x context parallelism (CP ranks are replicas)
    state = trained_bytes(params, inputs.param_itemsize, inputs.dp * inputs.cp, inputs.edp, role.distributed_optimizer)
    mini = role.train.mini_batch_size or inputs.samples_per_rank
    activations, logits = activation_bytes(model, layout, stage, inputs.micro_batch(role.train),
                                           inputs.micro_batches(role.train, mini), role.recompute, role.entropy_grad,
                                           critic, inputs.param_itemsize, inputs.kernel, inputs.cp,
                                           role.train.use_remove_padding)
    return RoleMemory(role.name, stage, state.params + params.fp32_buffer_numel * 4, state.grads, state.optimizer,
                      activations, logits, forward)


def memory_plan(inputs: RunInputs, hardware: Hardware, efficiency: Efficiency) -> MemoryPlan:
    capacity, context = hardware.memory_bytes, efficiency.cuda_context_gb * GB
    actor = inputs.role("actor")
    engine = engine_memory(actor.model, inputs.rollout, capacity, inputs.param_itemsize, efficiency.cuda_context_gb)
    stage_roles = {stage: {r.name: role_memory(inputs, r, stage) for r in inputs.roles} for stage in range(inputs.layout.pp)}
    colocated = inputs.placement.mode == "colocated"
    bucket = inputs.rollout.bucket_bytes
    phases: list[PhaseMemory] = []
    for name, offload_phase, runs in PHASES:
        if runs is not None and inputs.role(runs) is None:
            continue
        worst: PhaseMemory | None = None
        for stage, roles in stage_roles.items():
            phase = PhaseMemory(name, "colocated" if colocated else "trainer")
            for role, memory in roles.items():
                for kind in KINDS:
                    group = f"{role}.{kind}"
                    size = memory.group(kind)
                    if size and (group in NEEDS[offload_phase] or not inputs.offload.get(group, False)):
                        phase.items.append((f"{role} {kind}", size))
            if runs is not None:
                memory = roles[runs]
                if name.startswith("update"):
                    phase.items += [(f"{runs} activations", memory.activations), (f"{runs} logits", memory.logits)]
                else:
                    phase.items.append((f"{runs} forward", memory.forward))
            if name == "sync":
                phase.items.append(("sync buckets (sending)", 2 * bucket))
            phase.items.append(("trainer CUDA context", int(context)))
            if colocated:
                phase.items += _engine_items(name, engine, inputs, bucket, actor.model)
            if worst is None or phase.total > worst.total:
                worst = phase
        phases.append(worst)
    if not colocated:
        for name in ("generate", "sync"):
            phase = PhaseMemory(name, "rollout", _engine_items(name, engine, inputs, bucket, actor.model, split=True))
            phases.append(phase)
    roles = {name: max((stage_roles[s][name] for s in stage_roles),
                       key=lambda m: m.params + m.grads + m.optimizer + m.activations + m.logits)
             for name in stage_roles[0]}
    needed = -(-inputs.prompts_per_step * inputs.samples_per_prompt // inputs.rollout.replicas)
    return MemoryPlan(roles, stage_roles, engine, phases, capacity, needed)


def _engine_items(phase: str, engine: EngineMemory, inputs: RunInputs, bucket: int, model, split: bool = False):
    """The vLLM worker's share of a GPU in ``phase``."""
    receiving = ("sync buckets + tensor (receiving)", 2 * bucket + model.largest_tensor * inputs.param_itemsize)
    if phase == "generate" or split or not inputs.rollout.sleeps:
        items = [("vLLM (gpu_memory_utilization)", int(engine.budget))]
        return items + [receiving] if phase == "sync" else items
    if phase == "sync":  # the weights woke up for the sync, the KV cache not yet
        return [("vLLM weights", engine.weights), ("vLLM CUDA context", int(engine.context)), receiving]
    return [("vLLM asleep (CUDA context)", int(engine.context))]
