"""The batch arithmetic of a trained role (actor, critic): parallel sizes, mini- and micro-batches.

verl's rules: ``ppo_mini_batch_size`` counts prompts, so one mini-batch holds
``ppo_mini_batch_size * rollout.n`` samples spread over the data-parallel ranks, and each rank splits
its share into micro-batches (gradient accumulation steps). Every problem is reported in one pass: a
parallel size that does not divide the devices leaves the data-parallel size unknown, but the
checks that do not need it (the mini-batch divides the batch, the micro-batch is set and divides the
mini-batch's samples) still run, so fixing one key never reveals the next problem.
"""
from __future__ import annotations

from typing import Callable

# verl's deprecated global micro-batch keys next to their per-GPU form: verl refuses both given
DEPRECATED_MICRO = {"ppo_micro_batch_size": "ppo_micro_batch_size_per_gpu"}


def batch_problems(add: Callable, prefix: str, role, megatron, devices: int | None, train_batch_size: int,
                   n: int) -> None:
    """``add`` one message per problem of ``prefix``'s batches on ``devices`` trainer devices (None: unknown)."""
    dp = _data_parallel_size(add, prefix, megatron, devices)
    mini = role.ppo_mini_batch_size
    if mini < 1 or train_batch_size % mini:
        add(f"{prefix}.ppo_mini_batch_size={mini} must divide data.train_batch_size={train_batch_size}; "
            f"pick a divisor of {train_batch_size}.")
    samples = max(mini, 0) * n
    if dp is not None and samples % dp:
        add(f"{prefix}.ppo_mini_batch_size * rollout.n = {mini} * {n} = {samples} samples per mini-batch "
            f"do not split evenly over the {dp} data-parallel ranks; make it a multiple of {dp}.")
        dp = None  # the micro-batch below is checked against the whole mini-batch
    for old, new in DEPRECATED_MICRO.items():
        if role.get(old) is not None and role.get(new) is not None:
            add(f"{prefix}.{old}={role[old]} and {prefix}.{new}={role[new]} are both set: verl refuses the pair "
                f"(the first is its deprecated global form of the second); remove {prefix}.{old}.", f"{prefix}.{old}")
    if role.use_dynamic_bsz:
        return
    micro = role.ppo_micro_batch_size_per_gpu
    if micro is None and role.get("ppo_micro_batch_size") is not None and dp is not None:
        micro = max(role.ppo_micro_batch_size // dp, 1)  # verl's deprecated global form, as the engine converts it
    if micro is None and role.get("ppo_micro_batch_size") is not None:
        return  # its per-rank value needs the data-parallel size, reported above
    per_rank = samples // dp if dp is not None else samples
    where = (f"the {per_rank} samples each data-parallel rank gets per mini-batch (ppo_mini_batch_size * "
             f"rollout.n / DP = {mini} * {n} / {dp})" if dp is not None else
             f"the {samples} samples of a mini-batch (ppo_mini_batch_size * rollout.n = {mini} * {n}), and then "
             "each data-parallel rank's share of them")
    if micro is None:
        add(f"{prefix}.ppo_micro_batch_size_per_gpu is not set; set it (a divisor of {where}) or set "
            f"{prefix}.use_dynamic_bsz=True.")
    elif micro < 1 or per_rank % micro:
        add(f"{prefix}.ppo_micro_batch_size_per_gpu={micro} must divide {where}; otherwise gradient accumulation "
            f"would be fractional or 0 (NaN grad norms). Pick a divisor of {per_rank}.")


def _data_parallel_size(add: Callable, prefix: str, megatron, devices: int | None) -> int | None:
    """The role's data-parallel size on ``devices``, or None (unknown, or a parallel size is wrong: reported)."""
    tp, pp, cp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size, megatron.context_parallel_size
    ep, etp = megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size or tp
    model_parallel = tp * pp * cp
    if min(tp, pp, cp, ep, etp) < 1:
        add(f"{prefix}.megatron: parallel sizes must be >= 1 (tp={tp}, pp={pp}, cp={cp}, ep={ep}, etp={etp}).")
        return None
    vpp = megatron.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 1 or pp < 2):
        add(f"{prefix}.megatron.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size >= 2.")
    if devices is None or devices < 1:  # unknown: the placement's problem is reported with its keys
        return None
    if devices % model_parallel:
        add(f"trainer.n_gpus_per_node * trainer.nnodes = {devices} trainer devices is not divisible by "
            f"{prefix}.megatron TP x PP x CP = {tp} x {pp} x {cp} = {model_parallel}; change the node/GPU count "
            "or the parallel sizes.")
        return None
    if (devices // pp) % (ep * etp):
        add(f"{prefix}.megatron expert_model_parallel_size x expert_tensor_parallel_size = {ep} x {etp} must divide "
            f"the {devices // pp} devices of one pipeline stage.")
    return devices // model_parallel
