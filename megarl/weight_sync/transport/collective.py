"""Buckets as broadcasts on one process group per route, double-buffered; shared by gloo and nccl.

``connect`` creates, for every route ``(src, dsts)`` this rank is a member of, a standalone
process group over the sync store (``PrefixStore("route/<src>/<dsts>")``; group ranks are the
sorted members; the root is the source). The groups are created in sorted route order on every
participant, which cannot deadlock for the reason given in ``schedule``. No process joins the
default (training) group.

``run`` walks ``schedule.rank_schedule`` with at most ``window`` broadcasts in flight, each in
one of ``window`` reused buffers:

* a source packs bucket ``i`` while buckets ``i-window+1 .. i-1`` are on the wire;
* a destination hands bucket ``i`` to ``on_bucket`` while the next ones are being received;
* routes with different sources (every PP stage, every EP group) progress concurrently.

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
from megarl.weight_sync.packing import GetRegion, as_bytes, check_piece, pack_bucket, unpack_bucket
from megarl.weight_sync.planner import Bucket, SyncPlan
from megarl.weight_sync.schedule import Route, members, rank_schedule, route_of, routes_of
from megarl.weight_sync.transport.base import OnBucket, RecvInto, SyncStats, Transport, check_run, leave, rendezvous
from megarl.weight_sync.transport.liveness import FAILURE_GRACE_S, Heartbeat, describe_silent


def route_key(route: Route) -> str:
    src, dsts = route
    return f"route/{src}/{','.join(map(str, dsts))}"


@dataclass
class _InFlight:
    index: int  # in plan.buckets
    bucket: Bucket
    buffer: torch.Tensor
    work: object  # the backend's Work handle


class CollectiveTransport(Transport):
    """Windowed broadcasts on per-route process groups; subclasses pick the backend and the buffer device."""

    def __init__(self, window: int = 2) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (2 = double-buffered), got {window}")
        self.window = window
        self._rank: int | None = None
        self._world_size = 0
        self._store: dist.TCPStore | None = None
        self._heartbeat: Heartbeat | None = None
        self._groups: dict[Route, dist.ProcessGroup] = {}
        self._buffers: list[torch.Tensor] = []
        self._timeout = timedelta(seconds=300)
        self._failed: str | None = None

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
        if self._rank is not None:
            raise SyncError(f"transport already connected as rank {self._rank}; close() it first")
        self._timeout = timedelta(seconds=timeout_s)
        self._store = rendezvous(rank, world_size, master_addr, master_port, timeout_s)
        self._rank, self._world_size = rank, world_size
        self._heartbeat = Heartbeat(master_addr, master_port, rank)
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
        try:
            for step, index in enumerate(order):
                if len(inflight) == self.window:
                    current = inflight[0].index
                    self._finish(inflight.popleft(), plan, on_bucket)
                current, bucket = index, plan.buckets[index]
                buffer = self._buffers[step % self.window][:bucket.nbytes]
                if bucket.src == rank:
                    buffer = self._outgoing(bucket, plan, get_region, buffer)
                    sent += bucket.nbytes
                else:
                    buffer = self._landing(bucket, recv_into, buffer)
                    received += bucket.nbytes
                inflight.append(_InFlight(index, bucket, buffer, self._post(index, bucket, buffer)))
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
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._heartbeat = None
        self._groups.clear()
        self._buffers = []
        if self._rank is not None:
            leave(self._store, self._rank, self._world_size, self._leave_wait_s())
        self._store = None
        self._rank = None
        self._failed = None

    # ------------------------------------------------------------------ internals
    def _leave_wait_s(self) -> float:
        """The store host waits for everyone after a good sync, briefly after a failed one (dead ranks never leave)."""
        timeout = self._timeout.total_seconds()
        return min(timeout, FAILURE_GRACE_S) if self._failed else timeout

    def _ensure_buffers(self, nbytes: int) -> None:
        if self._buffers and self._buffers[0].numel() >= nbytes:
            return
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self._device()) for _ in range(self.window)]

    def _outgoing(self, bucket: Bucket, plan: SyncPlan, get_region: GetRegion, slot: torch.Tensor) -> torch.Tensor:
        """The bytes to send: the region's own memory for a one-region contiguous bucket, else packed into ``slot``."""
        if len(bucket.transfers) == 1:
            transfer = bucket.transfers[0]
            piece = check_piece(transfer, plan.meta, get_region(transfer.name, transfer.region))
            direct = as_bytes(piece) if piece.device.type == slot.device.type else None
            if direct is not None:
                return direct
            return pack_bucket(bucket, plan.meta, lambda name, region: piece, slot)
        return pack_bucket(bucket, plan.meta, get_region, slot)

    def _landing(self, bucket: Bucket, recv_into: RecvInto | None, slot: torch.Tensor) -> torch.Tensor:
        """Where to receive: the memory ``recv_into`` offers (same device, right size), else ``slot``."""
        offered = recv_into(bucket) if recv_into is not None else None
        if (offered is not None and offered.dtype == torch.uint8 and offered.numel() == bucket.nbytes
                and offered.is_contiguous() and offered.device.type == slot.device.type):
            return offered
        return slot

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
            op.work.wait(self._timeout)
        except Exception as exc:  # noqa: BLE001 - gloo/nccl raise RuntimeError on closed connections and timeouts
            raise self._error(op.index, op.bucket, exc) from exc
        if op.bucket.src != self._rank and on_bucket is not None:
            on_bucket(op.bucket, unpack_bucket(op.bucket, plan.meta, op.buffer))

    def _error(self, index: int, bucket: Bucket, exc: BaseException) -> SyncError:
        route = route_of(bucket)
        peers = [r for r in members(route) if r != self._rank]
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return SyncError(f"weight sync failed on rank {self._rank} at bucket {index}, route {route[0]} -> "
                         f"{list(route[1])} (peer ranks {peers}, timeout {self._timeout.total_seconds():g}s): "
                         f"{cause}{describe_silent(self._store, peers)}")
