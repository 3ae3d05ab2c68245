"""Rectangular regions of a tensor, the common coordinate of both sides of a weight sync.

A region is a tuple of half-open ``(start, stop)`` intervals, one per dimension, in the
coordinates of the *global Hugging Face tensor*. A Megatron TP shard of a fused QKV weight,
a vLLM worker's slice of ``gate_proj`` and a whole replicated norm are all regions.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

Region = tuple[tuple[int, int], ...]


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, int(n)) for n in shape)


def region_numel(region: Region) -> int:
    return math.prod(stop - start for start, stop in region)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in region)


def contains(outer: Region, inner: Region) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def intersect(a: Region, b: Region) -> Region | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(start < stop for start, stop in out) else None


def to_slices(region: Region, origin: Region | None = None) -> tuple[slice, ...]:
    """Slices selecting ``region`` from a tensor whose own extent is ``origin`` (default: the global tensor)."""
    if origin is None:
        return tuple(slice(start, stop) for start, stop in region)
    return tuple(slice(start - o0, stop - o0) for (start, stop), (o0, _) in zip(region, origin))


def split_rows(region: Region, row_elems_bytes: int, max_bytes: int) -> list[Region]:
    """Split a region along its first dimension of extent > 1 into chunks of at most ``max_bytes``.

    ``row_elems_bytes`` is the byte size of the region divided by that dimension's extent.
    A single row larger than ``max_bytes`` stays one chunk (it cannot be split further here).
    """
    dim = next((d for d, (s, e) in enumerate(region) if e - s > 1), None)
    if dim is None:
        return [region]
    start, stop = region[dim]
    rows_per_chunk = max(1, max_bytes // max(1, row_elems_bytes))
    chunks = []
    for s in range(start, stop, rows_per_chunk):
        chunk = list(region)
        chunk[dim] = (s, min(stop, s + rows_per_chunk))
        chunks.append(tuple(chunk))
    return chunks


def cut_points(regions: Iterable[Region], ndim: int) -> list[list[int]]:
    """Sorted boundaries per dimension of a set of regions."""
    cuts: list[set[int]] = [set() for _ in range(ndim)]
    for region in regions:
        for d, (start, stop) in enumerate(region):
            cuts[d].update((start, stop))
    return [sorted(c) for c in cuts]


def cells_within(region: Region, cuts: list[list[int]]) -> list[Region]:
    """The grid cells (formed by ``cuts``) that tile ``region``."""
    per_dim = []
    for (start, stop), c in zip(region, cuts):
        points = [p for p in c if start <= p <= stop]
        per_dim.append([(a, b) for a, b in zip(points, points[1:])])
    cells: list[Region] = [()]
    for intervals in per_dim:
        cells = [cell + (iv,) for cell in cells for iv in intervals]
    return cells


def merge_adjacent(regions: list[Region]) -> list[Region]:
    """Merge regions that together form a larger box (adjacent along one dim, equal on the others)."""
    regions = sorted(set(regions))
    changed = True
    while changed and len(regions) > 1:
        changed = False
        for dim in range(len(regions[0])):
            key = lambda r: tuple(iv for d, iv in enumerate(r) if d != dim) + (r[dim],)  # noqa: E731
            regions.sort(key=key)
            merged: list[Region] = []
            for region in regions:
                if merged:
                    last = merged[-1]
                    same_rest = all(last[d] == region[d] for d in range(len(region)) if d != dim)
                    if same_rest and last[dim][1] == region[dim][0]:
                        merged[-1] = tuple((last[d][0], region[d][1]) if d == dim else last[d]
                                           for d in range(len(region)))
                        changed = True
                        continue
                merged.append(region)
            regions = merged
    return sorted(regions)
