"""Buckets on one process group per route, double-buffered; shared by gloo and nccl.

``connect`` creates, for every route ``(src, dsts)`` this rank is a member of, a standalone
process group over the sync store (``PrefixStore("route/<src>/<dsts>")``; group ranks are the
sorted members; the root is the source). The groups are created in sorted route order on every
participant, which cannot deadlock for the reason given in ``schedule``. No process joins the
default (training) group.

``run`` walks ``schedule.rank_schedule`` with at most ``window`` buckets in flight, each with one
of ``window`` reused buffers:

* a source prepares bucket ``i`` while buckets ``i-window+1 .. i-1`` are on the wire;
* a destination hands bucket ``i`` to ``on_bucket`` while the next ones are being received;
* routes with different sources (every PP stage, every EP group) progress concurrently.

Two wire protocols, chosen by the backend (``per_region``):

* **one broadcast per bucket** (nccl): the source packs the bucket's regions into the buffer and
  the destinations unpack it; on GPUs those copies run at memory bandwidth, and one collective
  per bucket keeps the launch count low.
* **one p2p message per region and destination** (gloo): a contiguous region is sent from the
  source's own tensor and received straight into the receiver's tensor when it offers one
  (``recv_into``), so most bytes are never copied; the buffer only stages strided regions
  (column-split TP shards). On CPUs every copy competes with the sockets for the same cores,
  and a gloo p2p message costs ~0.07 ms against ~0.6 ms for a gloo broadcast (measured here).
  Both ends number a route's regions alike, which gives each message its tag.

The deadlock argument of ``schedule`` holds for both: a bucket's ops are all posted before any
later bucket's, on every member, in the global order.

Each wait is bounded by the timeout; a closed connection (a peer died) or a timeout raises a
``SyncError`` naming the rank, the bucket, its route and the peers. After a failure the
transport refuses further runs (its groups are out of step with the peers): close and connect.
"""
from __future__ import annotations

import abc
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.packing import GetRegion, offsets, pack_bucket, piece_bytes, region_view, unpack_bucket
from megarl.weight_sync.planner import Bucket, SyncPlan, Transfer
from megarl.weight_sync.schedule import Route, members, rank_schedule, route_of, routes_of
from megarl.weight_sync.transport.base import OnBucket, RecvInto, StoreTransport, SyncStats, check_run
from megarl.weight_sync.transport.liveness import describe_silent


def route_key(route: Route) -> str:
    src, dsts = route
    return f"route/{src}/{','.join(map(str, dsts))}"


TAG_LIMIT = 2**31 - 1  # p2p tags are C ints


@dataclass
class _InFlight:
    index: int  # in plan.buckets
    bucket: Bucket
    works: list  # the backend's Work handles
    buffer: torch.Tensor | None = None  # broadcast: the bucket's bytes
    landed: list[tuple[Transfer, torch.Tensor]] | None = None  # per region: where its bytes landed


class CollectiveTransport(StoreTransport):
    """Windowed buckets on per-route process groups; subclasses pick the backend, the buffer device
    and the wire protocol (``per_region``)."""

    per_region = False  # True: one p2p send/recv per region and destination instead of one broadcast

    def __init__(self, window: int = 2) -> None:
        super().__init__(window)
        self._groups: dict[Route, dist.ProcessGroup] = {}
        self._buffers: list[torch.Tensor] = []

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _new_group(self, store: dist.Store, group_rank: int, group_size: int, timeout: timedelta):
        """A standalone process group (backend object) over ``store``."""

    @abc.abstractmethod
    def _device(self) -> torch.device:
        """Where the bucket buffers live."""

    # ------------------------------------------------------------------ interface
    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, plan: SyncPlan,
                timeout_s: float = 300.0) -> None:
        self._connected(self._join(rank, world_size, master_addr, master_port, timeout_s), rank, world_size,
                        master_addr, master_port)
        for route in routes_of(plan, rank):
            group_members = members(route)
            prefixed = dist.PrefixStore(route_key(route), self._store)
            try:
                group = self._new_group(prefixed, group_members.index(rank), len(group_members), self._timeout)
            except Exception as exc:  # noqa: BLE001 - re-raised naming the route
                self.close()
                raise SyncError(f"sync rank {rank}: could not set up route {route[0]} -> {list(route[1])} "
                                f"(ranks {list(group_members)}) within {timeout_s:g}s; is every one of them "
                                f"running connect()? {exc}") from exc
            self._groups[route] = group

    def run(self, plan: SyncPlan, rank: int, get_region: GetRegion | None = None,
            on_bucket: OnBucket | None = None, recv_into: RecvInto | None = None) -> SyncStats:
        check_run(plan, rank, self._rank, set(self._groups), get_region, self._failed)
        order = rank_schedule(plan, rank)
        self._ensure_buffers(max((plan.buckets[i].nbytes for i in order), default=0))
        start = time.perf_counter()
        inflight: deque[_InFlight] = deque()
        sent = received = 0
        current = -1  # the bucket being worked on, for error messages
        tags: dict[Route, int] = {}  # per route, regions so far: both ends number them alike
        try:
            for step, index in enumerate(order):
                if len(inflight) == self.window:
                    current = inflight[0].index
                    self._finish(inflight.popleft(), plan, on_bucket)
                current, bucket = index, plan.buckets[index]
                slot = self._buffers[step % self.window][:bucket.nbytes]
                if bucket.src == rank:
                    sent += bucket.nbytes
                else:
                    received += bucket.nbytes
                if self.per_region:
                    inflight.append(self._post_regions(index, bucket, plan, slot, get_region, recv_into, tags))
                    continue
                if bucket.src == rank:
                    buffer = self._outgoing(bucket, plan, get_region, slot)
                else:
                    buffer = self._landing(bucket, recv_into, slot)
                inflight.append(_InFlight(index, bucket, [self._post(index, bucket, buffer)], buffer=buffer))
            while inflight:
                current = inflight[0].index
                self._finish(inflight.popleft(), plan, on_bucket)
        except SyncError as exc:
            self._failed = str(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - packing / on_bucket failures end the sync the same way
            self._failed = f"rank {rank}, bucket {current}: {exc}"
            raise SyncError(f"weight sync failed on rank {rank} at bucket {current}: "
                            f"{type(exc).__name__}: {exc}") from exc
        return SyncStats(sent, received, time.perf_counter() - start, len(order))

    def close(self) -> None:
        """Drop the groups and buffers (pending ops of a failed sync end at their timeout)."""
        self._groups.clear()
        self._buffers = []
        self._leave()

    # ------------------------------------------------------------------ internals
    def _ensure_buffers(self, nbytes: int) -> None:
        if self._buffers and self._buffers[0].numel() >= nbytes:
            return
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self._device()) for _ in range(self.window)]

    def _outgoing(self, bucket: Bucket, plan: SyncPlan, get_region: GetRegion, slot: torch.Tensor) -> torch.Tensor:
        """The bytes to send: the region's own memory for a one-region contiguous bucket, else packed into ``slot``."""
        if len(bucket.transfers) == 1:
            transfer = bucket.transfers[0]
            return piece_bytes(transfer, plan.meta, get_region(transfer.name, transfer.region), slot, 0)
        return pack_bucket(bucket, plan.meta, get_region, slot)

    def _landing(self, bucket: Bucket, recv_into: RecvInto | None, slot: torch.Tensor) -> torch.Tensor:
        """Where to receive a broadcast: the memory ``recv_into`` offers for a one-region bucket, else ``slot``."""
        offered = self._offered(bucket.transfers[0], recv_into, slot) if len(bucket.transfers) == 1 else None
        return slot if offered is None else offered

    @staticmethod
    def _offered(transfer: Transfer, recv_into: RecvInto | None, slot: torch.Tensor) -> torch.Tensor | None:
        """The memory ``recv_into`` offers for one region, if usable (flat uint8, right size, same device type)."""
        offered = recv_into(transfer) if recv_into is not None else None
        if (offered is not None and offered.dtype == torch.uint8 and offered.numel() == transfer.nbytes
                and offered.is_contiguous() and offered.device.type == slot.device.type):
            return offered
        return None

    def _post_regions(self, index: int, bucket: Bucket, plan: SyncPlan, slot: torch.Tensor,
                      get_region: GetRegion | None, recv_into: RecvInto | None, tags: dict) -> _InFlight:
        """Per-region mode: each region goes as its own p2p message, from the source's tensor when
        it is contiguous and into its final place when the receiver offers one; only the other
        regions pass through ``slot`` (at their packed offsets)."""
        route = route_of(bucket)
        group, ranks = self._groups[route], members(route)
        first = tags.get(route, 0)
        tags[route] = first + len(bucket.transfers)
        works, landed = [], []
        for k, (transfer, offset) in enumerate(zip(bucket.transfers, offsets(bucket))):
            tag = (first + k) % TAG_LIMIT
            if bucket.src == self._rank:
                data = piece_bytes(transfer, plan.meta, get_region(transfer.name, transfer.region), slot, offset)
                works += [self._p2p(group.send, data, ranks.index(dst), tag, index, bucket) for dst in bucket.dsts]
            else:
                into = self._offered(transfer, recv_into, slot)
                data = into if into is not None else slot[offset:offset + transfer.nbytes]
                works.append(self._p2p(group.recv, data, ranks.index(bucket.src), tag, index, bucket))
                landed.append((transfer, data))
        return _InFlight(index, bucket, works, landed=landed)

    def _p2p(self, op, data: torch.Tensor, peer: int, tag: int, index: int, bucket: Bucket):
        try:
            return op([data], peer, tag)
        except Exception as exc:  # noqa: BLE001 - the backend refused the op
            raise self._error(index, bucket, exc) from exc

    def _post(self, index: int, bucket: Bucket, buffer: torch.Tensor):
        route = route_of(bucket)
        options = dist.BroadcastOptions()
        options.rootRank = members(route).index(bucket.src)
        options.timeout = self._timeout
        try:
            return self._groups[route].broadcast([buffer], options)
        except Exception as exc:  # noqa: BLE001
            raise self._error(index, bucket, exc) from exc

    def _finish(self, op: _InFlight, plan: SyncPlan, on_bucket: OnBucket | None) -> None:
        try:
            for work in op.works:
                work.wait(self._timeout)
        except Exception as exc:  # noqa: BLE001 - gloo/nccl raise RuntimeError on closed connections and timeouts
            raise self._error(op.index, op.bucket, exc) from exc
        if op.bucket.src == self._rank or on_bucket is None:
            return
        if op.landed is None:
            on_bucket(op.bucket, unpack_bucket(op.bucket, plan.meta, op.buffer))
        else:  # in the receiver's tensor (no copy left to do) or at the region's offset in the slot
            on_bucket(op.bucket, [(t, region_view(data, 0, t, plan.meta)) for t, data in op.landed])

    def _error(self, index: int, bucket: Bucket, exc: BaseException) -> SyncError:
        route = route_of(bucket)
        peers = [r for r in members(route) if r != self._rank]
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return SyncError(f"weight sync failed on rank {self._rank} at bucket {index}, route {route[0]} -> "
                         f"{list(route[1])} (peer ranks {peers}, timeout {self._timeout.total_seconds():g}s): "
                         f"{cause}{describe_silent(self._store, peers)}")
