"""The merged weight ``W + (alpha / rank) * B @ A`` of an adapted linear, as the export and the weight
sync read it.

``MergedWeight`` stands for one rank's shard of the merged weight without materialising it: a
region is computed only when it is read (``merged[rows, cols]``), from the same region of ``W``,
the same rows of B and columns of A (a shard's A and B always match its weight's rows and
columns), in fp32, then cast to the weight's dtype. So a bf16 weight gets the update rounded once,
not ``B @ A`` rounded to bf16 first, and no rank ever holds a second copy of its weights.
``window(slices)`` narrows it without computing anything (the export's per-piece views).
"""
from __future__ import annotations

import torch

from megarl.models.lora.layers import LoRALinear


class MergedWeight:
    """A lazily merged view of ``module.weight`` (2-D), optionally restricted to a window."""

    def __init__(self, module: LoRALinear, rows: slice | None = None, cols: slice | None = None):
        out, inp = module.weight.shape
        self.module = module
        self.rows = rows or slice(0, out)
        self.cols = cols or slice(0, inp)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows.stop - self.rows.start, self.cols.stop - self.cols.start))

    @property
    def dtype(self) -> torch.dtype:
        return self.module.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.module.weight.device

    def _absolute(self, index) -> tuple[slice, slice]:
        if not isinstance(index, tuple) or len(index) != 2:
            raise IndexError(f"a merged weight is indexed by (rows, cols) slices, got {index!r}")
        absolute = []
        for s, window in zip(index, (self.rows, self.cols)):
            start, stop, step = s.indices(window.stop - window.start)
            if step != 1:
                raise IndexError(f"slice {s} has a step; merged regions are contiguous")
            absolute.append(slice(window.start + start, window.start + stop))
        return absolute[0], absolute[1]

    def window(self, index) -> "MergedWeight":
        rows, cols = self._absolute(index)
        return MergedWeight(self.module, rows, cols)

    @torch.no_grad()
    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = self._absolute(index)
        m = self.module
        weight = m.weight.detach()[rows, cols]
        update = m.lora_B_effective().detach()[rows].float() @ m.lora_A.detach()[:, cols].float()
        return (weight.float() + m.lora_scale * update).to(weight.dtype)

    def materialize(self) -> torch.Tensor:
        return self[:, :]


def exported_tensor(model: torch.nn.Module, param_name: str, tensor: torch.Tensor):
    """What the export reads for ``param_name`` of a model chunk: the merged weight of an adapted
    linear's ``weight``, the tensor itself otherwise."""
    if not param_name.endswith(".weight"):
        return tensor
    try:
        module = model.get_submodule(param_name.removesuffix(".weight"))
    except AttributeError:  # a grouped-GEMM expert's weight, a view under SequentialMLP's name: no adapter there
        return tensor
    return MergedWeight(module) if isinstance(module, LoRALinear) else tensor


def region(tensor, index):
    """``tensor[index]`` as a view: a window of a merged weight (still lazy) or a tensor view."""
    return tensor.window(index) if isinstance(tensor, MergedWeight) else tensor.detach()[index]
