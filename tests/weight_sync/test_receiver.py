"""The receiver: assembles exactly what its rank needs, hands tensors out as they complete, commits a sync.

Buckets are produced the way a source produces them (packed from the trainer shards of the test
world, then unpacked), fed in shuffled order, and the result is compared with the reference
tensors. The streaming test runs a real gloo transport between two threads.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.packing import pack_bucket, unpack_bucket
from megarl.weight_sync.planner import Piece, SyncPlan, TensorMeta, plan_sync
from megarl.weight_sync.receiver import WeightReceiver
from megarl.weight_sync.sender import region_reader
from megarl.weight_sync.transport import make_transport
from tests.weight_sync import _world
from tests.weight_sync._spawn import free_port

SEED = 11


def delivered(plan, rank, seed=SEED):
    """(bucket, unpacked pieces) for every bucket sent to ``rank``, packed from the sources' own shards."""
    readers = {r: region_reader(_world.local_shards(r, seed)) for r in _world.SOURCES}
    out = []
    for bucket in plan.buckets:
        if rank in bucket.dsts:
            buffer = pack_bucket(bucket, plan.meta, readers[bucket.src], torch.empty(bucket.nbytes, dtype=torch.uint8))
            out.append((bucket, unpack_bucket(bucket, plan.meta, buffer.clone())))
    return out


@pytest.mark.parametrize("mode", ["full", "shard"])
@pytest.mark.parametrize("rank", _world.RECEIVERS)
def test_assembles_the_needed_regions_bit_exact(mode, rank):
    plan = _world.make_plan(mode, bucket_bytes=700)
    receiver = WeightReceiver(plan, rank)
    receiver.begin()
    items = delivered(plan, rank)
    random.Random(rank).shuffle(items)
    got = {}
    for bucket, pieces in items:
        receiver.on_bucket(bucket, pieces)
        for name, tensor in receiver.take_ready():
            assert name not in got
            got[name] = tensor
    receiver.commit()
    assert not receiver.in_progress
    ref = _world.reference(SEED)
    assert sorted(got) == sorted(_world.TENSORS)
    for name, tensor in got.items():
        region = _world.expected_region(name, mode, rank)
        assert tensor.shape == ref[name].shape and tensor.dtype == ref[name].dtype
        assert torch.equal(tensor[region], ref[name][region])


def test_each_tensor_is_handed_out_as_soon_as_it_is_complete():
    plan = _world.make_plan("full", bucket_bytes=512)
    rank = 4
    receiver = WeightReceiver(plan, rank)
    receiver.begin()
    remaining = {name: sum(t.nbytes for b in plan.buckets if rank in b.dsts for t in b.transfers if t.name == name)
                 for name in _world.TENSORS}
    for bucket, pieces in delivered(plan, rank):
        receiver.on_bucket(bucket, pieces)
        before = {n for n, left in remaining.items() if left > 0}
        for t in bucket.transfers:
            remaining[t.name] -= t.nbytes
        just_completed = {n for n in before if remaining[n] == 0}
        assert {name for name, _ in receiver.take_ready()} == just_completed
    receiver.commit()


def test_a_missing_bucket_fails_the_commit():
    plan = _world.make_plan("full", bucket_bytes=700)
    receiver = WeightReceiver(plan, 5)
    receiver.begin()
    items = delivered(plan, 5)
    skipped_bucket, _ = items.pop(3)
    for bucket, pieces in items:
        receiver.on_bucket(bucket, pieces)
    with pytest.raises(SyncError, match="incomplete") as info:
        receiver.commit()
    for name in {t.name for t in skipped_bucket.transfers}:
        assert name in str(info.value)
    assert not receiver.in_progress
    # the next sync can succeed
    receiver.begin()
    for bucket, pieces in delivered(plan, 5):
        receiver.on_bucket(bucket, pieces)
    receiver.commit()


def test_duplicates_foreign_regions_and_out_of_sync_buckets_are_errors():
    plan = _world.make_plan("shard", bucket_bytes=700)
    receiver = WeightReceiver(plan, 4)
    items = delivered(plan, 4)
    with pytest.raises(SyncError, match="outside a sync"):
        receiver.on_bucket(*items[0])
    receiver.begin()
    receiver.on_bucket(*items[0])
    with pytest.raises(SyncError, match="twice"):
        receiver.on_bucket(*items[0])
    foreign = next(item for item in delivered(plan, 5) if 4 not in item[0].dsts)
    with pytest.raises(SyncError, match="which its plan does not send here"):
        receiver.on_bucket(*foreign)


def test_a_plan_that_does_not_cover_the_needs_is_rejected_up_front():
    plan = _world.make_plan("full", bucket_bytes=700)
    partial = SyncPlan(plan.buckets[1:], plan.meta, plan.needs)
    names = {t.name for t in plan.buckets[0].transfers}
    with pytest.raises(SyncError, match="does not deliver all of") as info:
        WeightReceiver(partial, plan.buckets[0].dsts[0])
    assert all(name in str(info.value) for name in names)
    overlapping = SyncPlan(plan.buckets + plan.buckets[:1], plan.meta, plan.needs)
    with pytest.raises(SyncError, match="sent here twice"):
        WeightReceiver(overlapping, plan.buckets[0].dsts[0])
    # two different regions that overlap (rows 0-4 and 2-6 of one tensor)
    meta = {"w": TensorMeta((8, 2), 4)}
    two = plan_sync([Piece(0, "w", ((0, 4), (0, 2))), Piece(1, "w", ((2, 6), (0, 2))), Piece(1, "w", ((6, 8), (0, 2)))],
                    [Piece(2, "w", ((0, 8), (0, 2)))], meta, 1 << 10)
    b0 = two.buckets[0]
    clash = [type(t)(t.src, t.dsts, t.name, ((2, 6), (0, 2)), t.nbytes) for t in b0.transfers]
    bad = SyncPlan(two.buckets + [type(b0)(b0.src, b0.dsts, clash)], meta, two.needs)
    with pytest.raises(SyncError, match=r"overlap"):
        WeightReceiver(bad, 2)


def test_single_region_buckets_land_in_place():
    plan = _world.make_plan("full", bucket_bytes=1024)  # embed_tokens / lm_head arrive as 1 KiB row chunks
    rank = 6
    receiver = WeightReceiver(plan, rank)
    receiver.begin()
    landed = 0
    for bucket, pieces in delivered(plan, rank):
        if len(bucket.transfers) == 1 and (into := receiver.recv_into(bucket.transfers[0])) is not None:
            landed += 1  # what a transport does: receive the bytes there, then report the bucket
            packed = torch.cat([data.contiguous().reshape(-1).view(torch.uint8) for _, data in pieces])
            into.copy_(packed)
            pieces = unpack_bucket(bucket, plan.meta, into)
        receiver.on_bucket(bucket, pieces)
    got = dict(receiver.take_ready())
    receiver.commit()
    ref = _world.reference(SEED)
    assert landed >= 16  # 2 x 8 KiB halves of each 16 KiB vocab matrix in 1 KiB chunks, and more
    assert all(torch.equal(got[name], ref[name]) for name in _world.TENSORS)


# ---------------------------------------------------------------- streaming through a real transport
def _two_rank_plan():
    meta = {f"w{i}": TensorMeta((16, 8), 4) for i in range(4)}
    full = {name: torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i, name in enumerate(meta)}
    plan = plan_sync([Piece(0, n, ((0, 16), (0, 8))) for n in meta], [Piece(1, n, ((0, 16), (0, 8))) for n in meta],
                     meta, bucket_bytes=16 * 8 * 4)  # one tensor per bucket
    return plan, full


def _source(plan, full, port, gate, last_name, errors):
    transport = make_transport("gloo", window=1)
    try:
        transport.connect(0, 2, "127.0.0.1", port, plan, timeout_s=20)
        shards = {n: [(((0, 16), (0, 8)), t)] for n, t in full.items()}
        read = region_reader(shards)

        def get_region(name, region):
            if name == last_name:  # the last bucket is packed only once the receiver's consumer has a tensor
                assert gate.wait(15), "the receiver did not hand out a tensor before the sync ended"
            return read(name, region)

        transport.run(plan, 0, get_region=get_region)
    except BaseException as exc:  # noqa: BLE001 - reported to the test thread
        errors.append(exc)
    finally:
        transport.close()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_receive_streams_tensors_before_the_last_bucket_is_sent():
    plan, full = _two_rank_plan()
    last_name = plan.buckets[-1].transfers[0].name
    gate, errors, port = threading.Event(), [], free_port()
    source = threading.Thread(target=_source, args=(plan, full, port, gate, last_name, errors))
    source.start()
    receiver, transport = WeightReceiver(plan, 1), make_transport("gloo", window=1)
    transport.connect(1, 2, "127.0.0.1", port, plan, timeout_s=20)
    got = {}
    for name, tensor in receiver.receive(transport):
        got[name] = tensor
        gate.set()
    transport.close()
    source.join(30)
    assert not errors, errors
    assert not receiver.in_progress
    assert receiver.last_stats.bytes_received == plan.bytes_sent
    assert all(torch.equal(got[n], full[n]) for n in full)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_consumer_that_stops_early_abandons_the_sync():
    plan, full = _two_rank_plan()
    gate, errors, port = threading.Event(), [], free_port()
    gate.set()
    source = threading.Thread(target=_source, args=(plan, full, port, gate, None, errors))
    source.start()
    receiver, transport = WeightReceiver(plan, 1), make_transport("gloo", window=1)
    transport.connect(1, 2, "127.0.0.1", port, plan, timeout_s=20)
    stream = receiver.receive(transport)
    next(stream)
    stream.close()  # e.g. vLLM's loader raised on the first tensor
    transport.close()
    source.join(30)
    assert not receiver.in_progress and receiver.last_stats is None  # nothing committed


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_recycling_reuses_consumed_tensors_across_syncs():
    plan, full = _two_rank_plan()
    receiver = WeightReceiver(plan, 1, recycle=True)
    addresses = []
    for version in (1, 2):
        gate, errors, port = threading.Event(), [], free_port()
        gate.set()
        source = threading.Thread(target=_source, args=(plan, full, port, gate, None, errors))
        source.start()
        transport = make_transport("gloo", window=1)
        transport.connect(1, 2, "127.0.0.1", port, plan, timeout_s=20)
        seen = set()
        for index, (name, tensor) in enumerate(receiver.receive(transport)):
            assert torch.equal(tensor, full[name])  # consumed (compared) before asking for the next
            seen.add(tensor.data_ptr())
            if version == 1 and index == 0:
                # the first sync holds its first tensor until everything has arrived: every tensor is in
                # progress at once, the most any sync can need, whatever the threads' timing in the second
                [rx] = [t for t in threading.enumerate() if t.name == "weight-sync-rx-1"]  # receive's transport thread
                rx.join(30)
                assert not rx.is_alive()
        transport.close()
        source.join(30)
        assert not errors, errors
        addresses.append(seen)
    assert addresses[1] <= addresses[0]  # the second sync allocated nothing new
