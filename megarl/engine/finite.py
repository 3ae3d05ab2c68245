"""Are a model's weights finite? One reduction per tensor on its device, one all-reduce for all ranks.

The trainer asks before every weight sync and every checkpoint save (``megarl.trainer.training_safety``):
a NaN in the weights would otherwise reach the rollout fleet or overwrite a good checkpoint. Each
tensor's largest magnitude (``vector_norm(ord=inf)``: one fused kernel, no temporary the size of
the tensor, and no overflow, unlike a sum or a 2-norm of large finite weights) is inf or NaN
exactly when the tensor holds an inf or a NaN. The per-tensor results stay on the device until
one count of the bad tensors, all-reduced over the group, comes back to the host: every rank
learns the same verdict from one host synchronisation (a second one only when something is bad,
to name the tensors). Imports nothing but torch, so it runs anywhere torch does.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]], group=None) -> tuple[int, list[str]]:
    """(the number of tensors holding inf/NaN on all ranks of ``group``, this rank's in order).

    Collective when torch.distributed is initialised: every rank of ``group`` must call it."""
    names, peaks = [], []
    for name, tensor in named:
        if tensor.numel():
            names.append(name)
            peaks.append(torch.linalg.vector_norm(tensor.detach(), float("inf")))
    bad = ~torch.isfinite(torch.stack([p.float() for p in peaks])) if peaks else None
    count = bad.sum() if bad is not None else torch.zeros((), dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        count = count.to(_collective_device(group), torch.int64)
        dist.all_reduce(count, group=group)
    total = int(count.item())
    local = [names[i] for i in bad.nonzero().flatten().tolist()] if total and bad is not None else []
    return total, local


def _collective_device(group) -> torch.device:
    """Where the group's backend reduces: the current GPU for NCCL, the host for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
