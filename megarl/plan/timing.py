"""How long a step's pieces take: generation, the Megatron passes, the weight sync.

* Training passes: FLOPs over the trainer GPUs' FLOP/s at ``Efficiency.mfu``. A forward is
  ``forward_flops_per_token`` per token (2 per active weight, MoE counting the ``topk`` experts a
  token visits, plus causal attention); an update is three forwards per epoch, four with full
  recompute; the pipeline bubble adds ``(pp - 1) / (micro-batches x vpp)``.
* Generation: a memory-bound decode. Each step reads the worker's weights (the MoE experts the
  step's tokens touch) and the KV cache of every running sequence from HBM at ``decode_hbm`` of
  its bandwidth, or is compute-bound when that is slower; the sequences of a replica run
  ``concurrent_sequences`` at a time; each step pays two TP all-reduces per layer; the prompts'
  prefill is compute-bound (once per prompt with prefix caching: its ``n`` samples share it).
* Sync: the link bytes of ``sync.sync_traffic`` at ``link`` of each link's line rate.

Every response is planned at ``response_length`` tokens: the times are upper bounds for a step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.plan.hardware import GB, Efficiency, Hardware
from megarl.plan.inputs import RoleInputs, RunInputs
from megarl.plan.memory import MemoryPlan
from megarl.plan.sync import SyncLayout, SyncTraffic, sync_traffic


@dataclass
class GenerationTime:
    sequences: int  # per replica
    concurrent: int
    waves: int
    prefill_s: float
    step_s: float  # one decode step at full concurrency
    decode_s: float
    bound: str  # memory | compute

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass
class TimePlan:
    generation: GenerationTime
    passes: dict[str, float] = field(default_factory=dict)  # log_prob, ref, values, update_critic, update_actor
    flops: dict[str, float] = field(default_factory=dict)
    sync_s: float = 0.0
    sync: SyncTraffic | None = None

    @property
    def step_s(self) -> float:
        return self.generation.seconds + sum(self.passes.values()) + self.sync_s


def generation_time(inputs: RunInputs, memory: MemoryPlan, hardware: Hardware, eff: Efficiency) -> GenerationTime:
    model, rollout, engine = inputs.role("actor").model, inputs.rollout, memory.engine
    sequences = memory.sequences_per_replica
    concurrent = max(1, min(engine.concurrent_sequences, sequences, rollout.max_num_seqs))
    waves = -(-sequences // concurrent)
    flops_per_s = hardware.bf16_tflops * 1e12 * rollout.tp
    active = model.active_params
    prompts = -(-sequences // inputs.samples_per_prompt) if rollout.prefix_caching else sequences
    prefill = prompts * rollout.prompt_length * 2 * active / (flops_per_s * eff.prefill_mfu)
    weights = engine.weights
    moe = model.dims.moe
    if moe is not None:  # experts no token of the step is routed to are not read
        experts = model.expert_params * inputs.param_itemsize / rollout.tp
        touched = 1 - (1 - moe.topk / moe.num_experts) ** concurrent
        weights = weights - experts + experts * touched
    context = rollout.prompt_length + rollout.response_length / 2
    read = weights + concurrent * context * engine.kv_bytes_per_token
    memory_s = read / (hardware.hbm_gbps * GB * eff.decode_hbm)
    compute_s = 2 * active * concurrent / (flops_per_s * eff.prefill_mfu)
    latency = eff.tp_latency_us if rollout.tp <= inputs.placement.per_node else eff.ib_latency_us
    step = max(memory_s, compute_s) + (2 * model.dims.num_layers * latency * 1e-6 if rollout.tp > 1 else 0.0)
    return GenerationTime(sequences, concurrent, waves, prefill, step, waves * rollout.response_length * step,
                          "memory" if memory_s >= compute_s else "compute")


def _pass_seconds(flops: float, inputs: RunInputs, hardware: Hardware, eff: Efficiency, micro_batches: int) -> float:
    bubble = (inputs.layout.pp - 1) / (micro_batches * inputs.layout.vpp) if inputs.layout.pp > 1 else 0.0
    return flops / (inputs.trainer_world * hardware.bf16_tflops * 1e12 * eff.mfu) * (1 + bubble)


def training_times(inputs: RunInputs, hardware: Hardware, eff: Efficiency) -> tuple[dict, dict]:
    seq = inputs.sequence_length
    tokens = inputs.prompts_per_step * inputs.samples_per_prompt * seq
    samples = inputs.samples_per_rank
    times, flops = {}, {}

    def forward(role: RoleInputs) -> float:
        return tokens * role.model.forward_flops_per_token(seq / 2)

    for name, role_name in (("log_prob", "actor"), ("ref", "ref"), ("values", "critic")):
        role = inputs.role(role_name)
        if role is None:
            continue
        flops[name] = forward(role)
        times[name] = _pass_seconds(flops[name], inputs, hardware, eff, inputs.micro_batches(role.forward, samples))
    for name, role_name in (("update_critic", "critic"), ("update_actor", "actor")):
        role = inputs.role(role_name)
        if role is None:
            continue
        passes = 4 if role.recompute.granularity == "full" else 3
        flops[name] = role.epochs * passes * forward(role)
        mini = role.train.mini_batch_size or samples
        times[name] = _pass_seconds(flops[name], inputs, hardware, eff, inputs.micro_batches(role.train, mini))
    return times, flops


def sync_layout(inputs: RunInputs) -> SyncLayout:
    placement = inputs.placement
    return SyncLayout(tuple(placement.trainer), tuple(tuple(r) for r in placement.replicas), placement.per_node,
                      inputs.rollout.sync_mode)


def time_plan(inputs: RunInputs, memory: MemoryPlan, hardware: Hardware, eff: Efficiency) -> TimePlan:
    generation = generation_time(inputs, memory, hardware, eff)
    passes, flops = training_times(inputs, hardware, eff)
    traffic = sync_traffic(inputs.role("actor").model, inputs.layout, sync_layout(inputs), inputs.param_itemsize)
    seconds = traffic.seconds(hardware.ib_gbps * GB * eff.link, hardware.nvlink_gbps * GB * eff.link)
    return TimePlan(generation, passes, flops, seconds, traffic)
