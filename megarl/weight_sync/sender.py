"""The source side: a trainer rank's local pieces of HF tensors, as the planner and the transport see them.

A trainer rank holds, for some HF tensors, some regions (a TP shard of ``q_proj`` is a row range,
a fused QKV shard is several row ranges of q, k and v, a norm is the whole tensor). ``LocalShards``
is that set: ``hf_name -> [(region, tensor)]`` with the tensor holding exactly the region (it may
be a view into a megatron parameter). From it:

* ``source_pieces`` lists what the rank can send, for ``plan_sync``;
* ``region_reader`` is the ``get_region(name, region)`` the transport packs from: it slices the
  local tensor that contains the requested region (a view), or assembles a region that spans
  several local pieces.

``from_export`` builds ``LocalShards`` from the bridge's export shape: an iterable of
``(hf_name, hf_slice, tensor)`` where ``hf_slice`` is a tuple of slices in global HF coordinates.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.packing import GetRegion
from megarl.weight_sync.planner import Piece
from megarl.weight_sync.regions import Region, contains, intersect, region_numel, region_shape, to_slices

LocalShards = Mapping[str, Sequence[tuple[Region, torch.Tensor]]]


def slice_to_region(hf_slice: Sequence[slice], shape: Sequence[int]) -> Region:
    """``(slice(a, b), ...)`` -> ``((a, b), ...)``; ``shape`` is the local tensor's (resolves open ends)."""
    if len(hf_slice) != len(shape):
        raise ValueError(f"slice {hf_slice} has {len(hf_slice)} dims, the tensor has {len(shape)}")
    region = []
    for s, n in zip(hf_slice, shape):
        if s.step not in (None, 1):
            raise ValueError(f"slice {s} has a step; an HF region is a contiguous range per dim")
        start = 0 if s.start is None else s.start
        stop = start + n if s.stop is None else s.stop
        region.append((start, stop))
    return tuple(region)


def from_export(items: Iterable[tuple[str, Sequence[slice], torch.Tensor]]) -> dict[str, list[tuple[Region, torch.Tensor]]]:
    """``LocalShards`` from ``(hf_name, hf_slice, tensor)`` triples (the bridge's per-rank export)."""
    shards: dict[str, list[tuple[Region, torch.Tensor]]] = {}
    for name, hf_slice, tensor in items:
        region = slice_to_region(hf_slice, tensor.shape)
        if region_shape(region) != tuple(tensor.shape):
            raise ValueError(f"{name}: slice {list(region)} covers {region_shape(region)} elements per dim "
                             f"but the tensor is {tuple(tensor.shape)}")
        shards.setdefault(name, []).append((region, tensor))
    return shards


def source_pieces(rank: int, shards: LocalShards) -> list[Piece]:
    """What sync rank ``rank`` holds, as planner pieces."""
    return [Piece(rank, name, region) for name, held in shards.items() for region, _ in held]


def region_reader(shards: LocalShards) -> GetRegion:
    """``get_region(name, region)``: the requested region of this rank's local pieces.

    A region inside one local tensor is returned as a view (no copy). The planner merges adjacent
    cells of one source into one region, so a region can also span several local pieces (the k
    rows of two query groups, which a fused-QKV shard keeps apart); it is then assembled into a
    new tensor from the pieces that tile it.
    """

    def get_region(name: str, region: Region) -> torch.Tensor:
        held = shards.get(name, ())
        for origin, tensor in held:
            if contains(origin, region):
                return tensor[to_slices(region, origin)]
        parts = [(overlap, origin, tensor) for origin, tensor in held
                 if (overlap := intersect(origin, region)) is not None]
        if parts and sum(region_numel(overlap) for overlap, _, _ in parts) == region_numel(region):
            first = parts[0][2]
            out = torch.empty(region_shape(region), dtype=first.dtype, device=first.device)
            for overlap, origin, tensor in parts:
                out[to_slices(overlap, region)] = tensor[to_slices(overlap, origin)]
            return out
        listed = [list(origin) for origin, _ in held]
        raise SyncError(f"asked to send {name}{list(region)}, but this rank holds {listed or 'no part of it'}; "
                        f"the plan was made from other shards than the ones given to the sender")

    return get_region
