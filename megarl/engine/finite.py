"""Are a model's weights finite? One reduction per tensor on its device, one all-reduce for all ranks.

The trainer asks before every weight sync and every checkpoint save (``megarl.trainer.training_safety``):
a NaN in the weights would otherwise reach the rollout fleet or overwrite a good checkpoint. A
tensor's sum is finite only when every element is (an inf or a NaN makes it inf or NaN), and a sum
is the cheapest reduction there is (29 times cheaper than the largest magnitude on one CPU core).
A non-finite sum may also come from huge finite weights overflowing, so those tensors, the
suspects (none in a healthy run), are confirmed by their largest magnitude (``vector_norm(ord=inf)``,
which cannot overflow). The per-tensor results stay on the device until one count, all-reduced over
the group, comes back to the host: every rank learns the same verdict from one host
synchronisation; suspects cost a second round, on every rank. Imports nothing but torch.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megarl.platform.distributed import collective_device


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]], group=None) -> tuple[int, list[str]]:
    """(the number of tensors holding inf/NaN on all ranks of ``group``, this rank's in order).

    Collective when torch.distributed is initialised: every rank of ``group`` must call it."""
    names, tensors = [], []
    for name, tensor in named:
        if tensor.numel():
            names.append(name)
            tensors.append(tensor.detach())
    suspect = ~torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors])) if tensors else None
    if _all_ranks(suspect, group) == 0:
        return 0, []
    bad = torch.zeros(len(tensors), dtype=torch.bool)
    for i in suspect.nonzero().flatten().tolist():  # an overflowing sum, or a true inf/NaN
        bad[i] = not bool(torch.isfinite(torch.linalg.vector_norm(tensors[i], float("inf"))))
    total = _all_ranks(bad if tensors else None, group)
    return total, [names[i] for i in bad.nonzero().flatten().tolist()] if total else []


def _all_ranks(flags: torch.Tensor | None, group) -> int:
    """How many flags are set on all ranks of ``group`` (one host synchronisation)."""
    count = flags.sum() if flags is not None else torch.zeros((), dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        count = count.to(collective_device(group), torch.int64)
        dist.all_reduce(count, group=group)
    return int(count.item())

