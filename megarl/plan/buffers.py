"""The bytes megatron-core allocates for a trained model's parameters, gradients and optimizer state.

megarl wraps every model chunk in mcore ``DistributedDataParallel`` (``engine/optimizer.py``:
``grad_reduce_in_fp32=True``, no overlapped reduction, so one bucket per buffer) and builds
megatron's optimizer (Adam; with ``use_distributed_optimizer`` the distributed one). This module
reproduces megatron-core 0.16.1's arithmetic (``distributed/param_and_grad_buffer.py``,
``optimizer/distrib_optimizer.py``), so the plan counts exactly what the engine allocates:

* DDP keeps one buffer per (chunk, dense | expert); parameters are laid out in reverse
  registration order, each starting at a multiple of 64 elements, each bucket padded to a
  multiple of ``lcm(dp, 128)`` (distributed optimizer only); the embedding shared across
  pipeline stages gets a bucket of its own. The gradient buffer is fp32; with the distributed
  optimizer the parameters also move into a buffer of the same layout (in their dtype).
* The distributed optimizer gives data-parallel rank ``r`` the ``r``-th of ``dp`` equal slices of
  every bucket; for every parameter element in its slice it keeps an fp32 master copy (only for
  16-bit parameters: fp32 parameters are their own master), Adam's two fp32 moments, and one
  fp32 step count per parameter range. Expert buffers split over the expert-data-parallel ranks.
* Without the distributed optimizer, every rank keeps master weights (16-bit parameters) and
  both moments of all its parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.plan.model import StageParams

FP32 = 4
ALIGN_PARAM = 64  # elements: each parameter starts 128-byte aligned (megatron: "64 values")
ALIGN_BUCKET = 128


@dataclass(frozen=True)
class Bucket:
    """One DDP bucket: its padded size and the [start, stop) element range of each parameter in it."""

    numel: int
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TrainedBytes:
    """Per-rank bytes of one trained model (actor or critic) on one data-parallel rank."""

    params: int  # the parameters (in the parameter buffer with the distributed optimizer)
    grads: int  # the fp32 gradient buffers
    optimizer: int  # master weights, Adam moments and step counts of this rank's slice

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def buffer_buckets(numels: list[tuple[int, bool]], dp: int, distributed: bool) -> list[Bucket]:
    """Buckets of one DDP buffer; ``numels`` in registration order as (numel, shared_embedding)."""
    bucket_divisor = math.lcm(dp, ALIGN_BUCKET)
    buckets, ranges, start, bucket_start = [], [], 0, 0

    def close(end: int) -> int:
        nonlocal ranges, bucket_start
        padded = _pad(end, bucket_divisor) if distributed else end
        buckets.append(Bucket(padded - bucket_start, tuple((s - bucket_start, e - bucket_start) for s, e in ranges)))
        ranges, bucket_start = [], padded
        return padded

    for numel, shared in reversed(numels):  # megatron lays parameters out in reverse order
        if distributed:
            start = _pad(start, ALIGN_PARAM)
        if shared and ranges:
            start = close(start)
        ranges.append((start, start + numel))
        start += numel
        if shared:
            start = close(start)
    if ranges:
        close(start)
    return buckets


def slice_numel(buckets: list[Bucket], dp: int, dp_rank: int) -> tuple[int, int]:
    """(parameter elements, parameter ranges) that data-parallel rank ``dp_rank`` owns in the buckets."""
    elements = pieces = 0
    for bucket in buckets:
        size = bucket.numel // dp
        lo, hi = dp_rank * size, (dp_rank + 1) * size
        for start, stop in bucket.ranges:
            overlap = min(stop, hi) - max(start, lo)
            if overlap > 0:
                elements += overlap
                pieces += 1
    return elements, pieces


def trained_bytes(stage: StageParams, param_itemsize: int, dp: int, edp: int, distributed: bool,
                  dp_rank: int | None = None, edp_rank: int | None = None) -> TrainedBytes:
    """Parameters, gradients and optimizer state of one rank of ``stage``.

    ``dp`` / ``edp``: the (expert) data-parallel sizes the dense / expert buffers are split over;
    ``dp_rank`` / ``edp_rank``: which slices to count (None: the largest, what must fit on every rank).
    """
    params = grads = optimizer = 0
    master = FP32 if param_itemsize < FP32 else 0  # fp32 parameters are their own master copy
    for chunk in sorted({p.chunk for p in stage.params}):
        for expert, size, rank in ((False, dp, dp_rank), (True, edp, edp_rank)):
            members = [(p.numel, p.shared_embedding) for p in stage.params if p.chunk == chunk and p.expert == expert]
            if not members:
                continue
            buckets = buffer_buckets(members, size, distributed)
            padded = sum(b.numel for b in buckets)
            grads += padded * FP32
            if distributed:
                params += padded * param_itemsize
                ranks = range(size) if rank is None else [rank]
                elements, pieces = max(slice_numel(buckets, size, r) for r in ranks)
                optimizer += elements * (master + 2 * FP32) + pieces * FP32
            else:
                numel = sum(n for n, _ in members)
                params += numel * param_itemsize
                optimizer += numel * (master + 2 * FP32) + len(members) * FP32
    return TrainedBytes(params, grads, optimizer)


def frozen_bytes(stage: StageParams, param_itemsize: int) -> int:
    """A model without gradients (the reference): its parameters as built, plus its fp32 buffers."""
    return stage.numel * param_itemsize + stage.fp32_buffer_numel * FP32
