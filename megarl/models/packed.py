"""Checkpoint tensors that pack several of the bridge's HF-side tensors (``FamilySpec.packed_tensors``).

Why: the shard layout, the loader and the exporter work on HF tensors that a megatron parameter
takes rows or columns of. gpt-oss's checkpoints store each layer's experts as one tensor
``[experts, hidden, 2 * ffn]`` (transposed, gate and up interleaved column by column) and their
biases as ``[experts, 2 * ffn]``. Its family names one part per expert (``...experts.<e>.gate_proj``,
``up_proj``, ``down_proj`` and their biases) in its ``ParamMap``s, so every TP/EP split is an
ordinary one; this module maps between those parts and the checkpoint tensors:

* ``read_piece``: the loader reads the part's row of the packed tensor (one expert's row, never the
  whole tensor), makes the part of it and takes the piece's slice; a row stored in another format
  (gpt-oss's MXFP4 experts, ``megarl.models.mxfp4``) comes from the reader it is given;
* ``pack_stream``: the exporter's stream of parts becomes the checkpoint's tensors, each packed
  tensor yielded once its last part arrives, so an export reproduces the checkpoint bit for bit;
* ``expert_rows``: a weight sync's stream of parts becomes each expert's row on its own
  (``PackedTensor.row_name``), yielded once that expert's parts arrived: what vLLM's gpt-oss loader
  takes (``FamilySpec.vllm_takes_expert_rows``). The sync plans, splits and sends the parts as
  ordinary tensors; the rows are packed in the rollout worker, so no rank holds a layer's experts
  whole. In the sync's shard mode a part holds only this rollout rank's region (the rest is
  uninitialised), and the region of the row that vLLM's loader reads is made of those regions
  exactly: the column chunk of the interleaved ``gate_up_proj`` of a TP rank is its row chunk of
  gate and of up, interleaved (``tests/models/test_vllm_expert_rows.py`` checks this against
  vLLM's loader).
"""
from __future__ import annotations

from typing import Iterator

import torch

from megarl.models.families.base import PackedTensor


def packed_parts(family, dims) -> dict[str, tuple[PackedTensor, int, object]]:
    """Bridge name -> (its packed tensor, its row, row -> the part), for every packed part of the model."""
    parts = {}
    for packed in family.packed_tensors(dims):
        for name, (row, unpack) in packed.parts.items():
            parts[name] = (packed, row, unpack)
    return parts


def read_piece(handle, part: tuple[PackedTensor, int, object], hf_slice: tuple[slice, ...],
               read_row=None) -> torch.Tensor:
    """The slice ``hf_slice`` of a packed part, read from the open safetensors file ``handle``, or by
    ``read_row(name, shape, row)`` (the packed tensor's row) when it is given."""
    packed, row, unpack = part
    if read_row is not None:
        return unpack(read_row(packed.name, packed.shape, row))[hf_slice].contiguous()
    stored = tuple(handle.get_slice(packed.name).get_shape())
    if stored != packed.shape:
        raise ValueError(f"{packed.name}: checkpoint shape {stored} != config shape {packed.shape}")
    return unpack(handle.get_slice(packed.name)[row:row + 1][0])[hf_slice].contiguous()


def pack_stream(family, dims, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` with every packed part replaced by its packed tensor (yielded when complete)."""
    parts = packed_parts(family, dims)
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if name not in parts:
            yield name, tensor
            continue
        packed = parts[name][0]
        have = waiting.setdefault(packed.name, {})
        have[name] = tensor
        if len(have) == len(packed.parts):
            yield packed.name, packed.pack(waiting.pop(packed.name))
    if waiting:
        raise RuntimeError(f"packed tensors left incomplete by the export: {sorted(waiting)}")


def expert_rows(family, dims, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` with every packed part replaced by its expert's row of the packed tensor, named
    ``PackedTensor.row_name``, yielded when all of that row's parts arrived (see the module docstring)."""
    parts = packed_parts(family, dims)
    counts: dict[tuple[str, int], int] = {}
    for packed, row, _ in parts.values():
        counts[packed.name, row] = counts.get((packed.name, row), 0) + 1
    waiting: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if name not in parts:
            yield name, tensor
            continue
        packed, row, _ = parts[name]
        have = waiting.setdefault((packed.name, row), {})
        have[name] = tensor
        if len(have) == counts[packed.name, row]:
            yield packed.row_name(row), packed.row(waiting.pop((packed.name, row)), row).contiguous()
    if waiting:
        raise RuntimeError(f"expert rows left incomplete by the sync: {sorted(f'{n} (expert {e})' for n, e in waiting)}")
