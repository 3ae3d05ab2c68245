"""The weight-sync planner: who sends which slice of which HF tensor to whom, in buckets.

A pure function of two layouts, so a 671B layout can be planned on a laptop:

* ``sources``: what each trainer rank holds, as ``Piece(rank, hf_name, region)``. Replicas
  (a norm held by every TP rank, data-parallel copies) simply appear several times.
* ``needs``: what each rollout rank must receive, in the same coordinates.

The plan guarantees, and ``SyncPlan.check`` verifies:

* every needed element is delivered to every rank that needs it, exactly once;
* every element leaves exactly one source (a region needed by several rollout ranks, e.g. the
  same shard in every data-parallel replica, is sent once and fanned out by broadcast);
* the sending is spread over all source ranks that hold a copy (least-loaded first), so every
  PP stage and EP group sends in parallel;
* transfers with the same (source, destinations) are packed in order into buckets of at most
  ``bucket_bytes`` (a larger region is split into row chunks).

Both sides compute the same plan from the same inputs, so a bucket needs no metadata on the
wire: the receiver knows the name, region and offset of every byte it gets.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from megarl.weight_sync.regions import (Region, cells_within, contains, cut_points, merge_adjacent,
                                        region_numel, split_rows)


@dataclass(frozen=True)
class Piece:
    """A region of one HF tensor held by (source) or needed at (destination) one rank."""

    rank: int
    name: str
    region: Region


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    itemsize: int  # bytes per element on the wire
    dtype: str = "float32"


@dataclass(frozen=True)
class Transfer:
    src: int
    dsts: tuple[int, ...]
    name: str
    region: Region
    nbytes: int


@dataclass
class Bucket:
    src: int
    dsts: tuple[int, ...]
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@dataclass
class SyncPlan:
    buckets: list[Bucket]
    meta: dict[str, TensorMeta]
    needs: list[Piece]

    @property
    def bytes_sent(self) -> int:
        """Bytes leaving source ranks (each region once, however many ranks receive it)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def bytes_delivered(self) -> int:
        return sum(b.nbytes * len(b.dsts) for b in self.buckets)

    def bytes_needed(self) -> int:
        return sum(region_numel(p.region) * self.meta[p.name].itemsize for p in self.needs)

    def bytes_by_source(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for b in self.buckets:
            out[b.src] += b.nbytes
        return dict(out)

    def check(self) -> None:
        """Raise if any needed element is delivered zero or several times to a rank."""
        received: dict[tuple[int, str], list[Region]] = defaultdict(list)
        for bucket in self.buckets:
            for t in bucket.transfers:
                for dst in t.dsts:
                    received[(dst, t.name)].append(t.region)
        for p in self.needs:
            got = [r for r in received.get((p.rank, p.name), []) if contains(p.region, r)]
            covered = sum(region_numel(r) for r in got)
            if covered != region_numel(p.region):
                raise AssertionError(f"rank {p.rank} needs {p.name}{list(p.region)}: {covered} of "
                                     f"{region_numel(p.region)} elements planned")
        if self.bytes_delivered != self.bytes_needed():
            raise AssertionError(f"planned {self.bytes_delivered} bytes for {self.bytes_needed()} needed")


class PlanError(ValueError):
    pass


def plan_sync(sources: Iterable[Piece], needs: Iterable[Piece], meta: Mapping[str, TensorMeta],
              bucket_bytes: int) -> SyncPlan:
    if bucket_bytes < 1:
        raise PlanError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    sources, needs = list(sources), list(needs)
    src_by_name: dict[str, list[Piece]] = defaultdict(list)
    need_by_name: dict[str, list[Piece]] = defaultdict(list)
    for p in sources:
        src_by_name[p.name].append(p)
    for p in needs:
        if p.name not in meta:
            raise PlanError(f"rank {p.rank} needs '{p.name}', which has no tensor metadata")
        need_by_name[p.name].append(p)

    load: dict[int, int] = defaultdict(int)  # bytes assigned per source rank so far
    transfers: list[Transfer] = []
    # Tensors held and needed alike (an expert's weights in every layer of a stage) share their geometry.
    geometry: dict[tuple, list[tuple[tuple[int, ...], tuple[int, ...], list[tuple[Region, int]], int]]] = {}
    # Big tensors first, so the greedy least-loaded choice balances well. Regions repeat (a 671B model's 1.4 M
    # needed pieces have a few hundred distinct regions): each region's size is computed once.
    numel = functools.cache(region_numel)
    order = sorted(need_by_name, key=lambda n: -sum(numel(p.region) for p in need_by_name[n]))
    for name in order:
        tensor_sources, tensor_needs = src_by_name.get(name, []), need_by_name[name]
        key = (tuple((p.rank, p.region) for p in tensor_sources), tuple((p.rank, p.region) for p in tensor_needs))
        if key not in geometry:
            geometry[key] = _cell_groups(name, tensor_sources, tensor_needs, len(meta[name].shape))
        transfers.extend(_assign_sources(name, geometry[key], meta[name], load))
    return SyncPlan(_bucketize(transfers, meta, bucket_bytes), dict(meta), needs)


def _cell_groups(name: str, sources: list[Piece], needs: list[Piece], ndim: int):
    """The tensor cut into cells, grouped by (ranks holding them, ranks needing them):
    ``[(holders, dsts, merged regions, elements)]``."""
    if not sources:
        raise PlanError(f"no trainer rank holds '{name}' (needed by rollout ranks "
                        f"{sorted({p.rank for p in needs})})")
    cuts = cut_points([p.region for p in sources] + [p.region for p in needs], ndim)
    # cell -> destination ranks that need it
    cell_dsts: dict[Region, set[int]] = defaultdict(set)
    for p in needs:
        for cell in cells_within(p.region, cuts):
            cell_dsts[cell].add(p.rank)
    # group cells by (candidate sources, destinations): one source is picked per group, so a
    # contiguous shard goes out from one rank rather than alternating between replicas
    holders_of: dict[Region, list[int]] = defaultdict(list)  # data-parallel copies share one region
    for p in sources:
        holders_of[p.region].append(p.rank)
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Region]] = defaultdict(list)
    for cell, dsts in cell_dsts.items():
        holders = tuple(sorted({r for region, ranks in holders_of.items() if contains(region, cell) for r in ranks}))
        if not holders:
            raise PlanError(f"no trainer rank holds {name}{list(cell)} (needed by rollout ranks {sorted(dsts)})")
        groups[(holders, tuple(sorted(dsts)))].append(cell)
    out = []
    for (holders, dsts), cells in sorted(groups.items()):
        regions = merge_adjacent(cells) if len(cells) > 1 else cells
        sized = [(region, region_numel(region)) for region in regions]
        out.append((holders, dsts, sized, sum(n for _, n in sized)))
    return out


def _assign_sources(name: str, groups, meta: TensorMeta, load: dict[int, int]) -> list[Transfer]:
    """One source per group, the least loaded so far; its regions become transfers."""
    out = []
    itemsize = meta.itemsize
    for holders, dsts, regions, numel in groups:
        src = min(holders, key=lambda r: (load[r], r))
        load[src] += numel * itemsize
        out.extend(Transfer(src, dsts, name, region, n * itemsize) for region, n in regions)
    return out


def _bucketize(transfers: list[Transfer], meta: Mapping[str, TensorMeta], bucket_bytes: int) -> list[Bucket]:
    by_route: dict[tuple[int, tuple[int, ...]], list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_route[(t.src, t.dsts)].append(t)
    buckets: list[Bucket] = []
    for (src, dsts), items in sorted(by_route.items()):
        current, current_bytes = Bucket(src, dsts), 0  # bytes kept here: Bucket.nbytes sums every call
        for t in sorted(items, key=lambda t: (t.name, t.region)):
            pieces = [t]
            if t.nbytes > bucket_bytes:
                row_bytes = t.nbytes // max(1, next((e - s for s, e in t.region if e - s > 1), 1))
                pieces = [Transfer(src, dsts, t.name, r, region_numel(r) * meta[t.name].itemsize)
                          for r in split_rows(t.region, row_bytes, bucket_bytes)]
            for piece in pieces:
                if current.transfers and current_bytes + piece.nbytes > bucket_bytes:
                    buckets.append(current)
                    current, current_bytes = Bucket(src, dsts), 0
                current.transfers.append(piece)
                current_bytes += piece.nbytes
        if current.transfers:
            buckets.append(current)
    return buckets
