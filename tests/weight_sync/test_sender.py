"""The source side: local shards -> planner pieces and the region reader the transport packs from."""
from __future__ import annotations

import pytest
import torch

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.planner import Piece, TensorMeta, plan_sync
from megarl.weight_sync.sender import from_export, region_reader, slice_to_region, source_pieces


def test_export_triples_become_local_shards():
    full = torch.arange(48.0).view(8, 6)
    # a fused-QKV-like TP shard: two row ranges of one HF tensor held as two local tensors
    items = [("w", (slice(0, 2), slice(0, 6)), full[0:2].clone()), ("w", (slice(4, 6), slice(0, 6)), full[4:6].clone()),
             ("n", (slice(None), ), torch.ones(6))]
    shards = from_export(items)
    assert [r for r, _ in shards["w"]] == [((0, 2), (0, 6)), ((4, 6), (0, 6))]
    assert shards["n"][0][0] == ((0, 6),)
    assert source_pieces(3, shards) == [Piece(3, "w", ((0, 2), (0, 6))), Piece(3, "w", ((4, 6), (0, 6))),
                                        Piece(3, "n", ((0, 6),))]
    read = region_reader(shards)
    piece = read("w", ((4, 6), (2, 5)))
    assert torch.equal(piece, full[4:6, 2:5])
    assert piece.data_ptr() == shards["w"][1][1][0, 2].data_ptr()  # a view, no copy
    with pytest.raises(SyncError, match=r"asked to send w\[\(1, 3\), \(0, 6\)\], but this rank holds"):
        read("w", ((1, 3), (0, 6)))  # rows 2-4 are not on this rank: the plan was made from other shards


def test_a_region_spanning_adjacent_local_pieces_is_assembled():
    full = torch.arange(48.0).view(8, 6)
    # k rows of two query groups: adjacent in the HF tensor, separate in the fused QKV shard
    shards = from_export([("k", (slice(0, 2), slice(0, 6)), full[0:2].clone()),
                          ("k", (slice(2, 4), slice(0, 6)), full[2:4].clone())])
    assert torch.equal(region_reader(shards)("k", ((1, 4), (2, 5))), full[1:4, 2:5])


def test_bad_slices_are_rejected():
    with pytest.raises(ValueError, match="has a step"):
        slice_to_region((slice(0, 4, 2),), (2,))
    with pytest.raises(ValueError, match=r"covers \(3,\) elements per dim but the tensor is \(2,\)"):
        from_export([("w", (slice(0, 3),), torch.zeros(2))])


def test_pieces_plan_and_read_back_a_split_tensor():
    full = torch.randn(8, 4)
    ranks = {0: from_export([("w", (slice(0, 4), slice(0, 4)), full[:4].clone())]),
             1: from_export([("w", (slice(4, 8), slice(0, 4)), full[4:].clone())])}
    sources = [p for rank, shards in ranks.items() for p in source_pieces(rank, shards)]
    plan = plan_sync(sources, [Piece(2, "w", ((0, 8), (0, 4)))], {"w": TensorMeta((8, 4), 4)}, 1 << 20)
    rebuilt = torch.empty(8, 4)
    for bucket in plan.buckets:
        read = region_reader(ranks[bucket.src])
        for t in bucket.transfers:
            rebuilt[tuple(slice(a, b) for a, b in t.region)] = read(t.name, t.region)
    assert torch.equal(rebuilt, full)
