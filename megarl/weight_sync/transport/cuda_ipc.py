"""The colocated transport: receivers copy buckets straight out of the source's memory (CUDA IPC).

When the trainer and the rollout workers share a node (colocated mode: a trainer rank and a
vLLM worker on the same GPU, or on GPUs of one node), no byte needs a network: the source packs
a bucket into one of ``window`` buffers it owns, publishes an IPC handle to that buffer through
the sync store, and every destination maps the buffer, copies its regions out and acknowledges.
The source reuses a buffer once all destinations acknowledged the bucket in it.

Handles (``ipc_handles``: a fixed JSON format, checked field by field; nothing read from the store
is unpickled). On GPUs a handle holds the fields of torch's CUDA IPC reduction of the buffer (a CUDA
IPC memory handle; a receiver on another GPU of the node maps it through peer access). On a
machine without CUDA the buffers are files in ``/dev/shm`` mapped by both sides
(``torch.from_file(shared=True)``), which is the same protocol over host shared memory; the
tests run that variant with real processes. ``close()`` removes a source's files; a source that
is killed leaves its ``/dev/shm/megarl-sync-<pid>-*`` files behind. The CUDA variant is untested on the CPU-only
development machines.

Order and deadlock freedom follow ``schedule``: every participant walks its buckets in the
global order; a source has at most ``window`` unacknowledged buckets. Every store wait is
bounded by the timeout; a peer that died shows up as a missing handle (receivers) or missing
acknowledgements (the source), and the ``SyncError`` names those ranks.
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from collections import deque
from typing import Mapping

import torch

from megarl import platform
from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.packing import GetRegion, pack_bucket, unpack_bucket
from megarl.weight_sync.planner import SyncPlan
from megarl.weight_sync.schedule import Route, members, rank_schedule, routes_of
from megarl.weight_sync.transport import ipc_handles
from megarl.weight_sync.transport.base import OnBucket, RecvInto, StoreTransport, SyncStats, check_run
from megarl.weight_sync.transport.liveness import describe_silent


def check_colocated(routes: list[Route], host_of: Mapping[int, str]) -> None:
    """Raise unless every route's ranks run on one host (IPC handles do not cross nodes)."""
    for route in routes:
        hosts = {host_of[r] for r in members(route)}
        if len(hosts) > 1:
            placed = {r: host_of[r] for r in members(route)}
            raise SyncError(f"cuda_ipc transport: route {route[0]} -> {list(route[1])} spans hosts {placed}; "
                            f"colocated mode needs each trainer rank and the rollout workers it feeds on one "
                            f"node; use transport 'nccl' (or 'gloo') for this placement")


class _CudaIpcBuffers:
    """Buffers on this process's GPU, shared as CUDA IPC handles (each handle opened once per receiver)."""

    def __init__(self) -> None:
        self._opened: dict[bytes, torch.Tensor] = {}

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, bytes]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=platform.device())
        return buffer, ipc_handles.encode_cuda(buffer)

    def open(self, handle: bytes) -> torch.Tensor:
        if handle not in self._opened:
            found = ipc_handles.decode(handle)
            if not isinstance(found, ipc_handles.CudaHandle):
                raise ipc_handles.HandleError("a host shared-memory handle reached a CUDA receiver")
            self._opened[handle] = ipc_handles.open_cuda(found)
        return self._opened[handle]

    def ready(self) -> None:
        platform.synchronize()  # packing / copying kernels finished before the other side looks

    def release(self) -> None:
        self._opened.clear()


class _HostSharedBuffers:
    """Buffers in ``/dev/shm`` files mapped by sender and receivers; the protocol on machines without CUDA."""

    def __init__(self) -> None:
        self._owned: list[str] = []
        self._opened: dict[bytes, torch.Tensor] = {}

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, bytes]:
        path = f"{ipc_handles.HOST_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._owned.append(path)
        return buffer, ipc_handles.encode_host(path, nbytes)

    def open(self, handle: bytes) -> torch.Tensor:
        if handle not in self._opened:
            found = ipc_handles.decode(handle)
            if not isinstance(found, ipc_handles.HostHandle):
                raise ipc_handles.HandleError("a CUDA handle reached a receiver without CUDA")
            self._opened[handle] = ipc_handles.open_host(found)
        return self._opened[handle]

    def ready(self) -> None:
        pass

    def release(self) -> None:
        self._opened.clear()
        for path in self._owned:
            if os.path.exists(path):
                os.unlink(path)
        self._owned.clear()


class CudaIpcTransport(StoreTransport):
    name = "cuda_ipc"

    def __init__(self, window: int = 2) -> None:
        super().__init__(window)
        self._routes: set[Route] = set()
        self._shared = _CudaIpcBuffers() if platform.has_cuda() else _HostSharedBuffers()
        self._slots: list[tuple[torch.Tensor, bytes]] = []
        self._runs = 0

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, plan: SyncPlan,
                timeout_s: float = 300.0) -> None:
        store = self._join(rank, world_size, master_addr, master_port, timeout_s)
        store.set(f"host/{rank}", socket.gethostname())
        routes = routes_of(plan, rank)
        peers = sorted({r for route in routes for r in members(route)})
        try:
            store.wait([f"host/{r}" for r in peers], self._timeout)
        except Exception as exc:  # noqa: BLE001
            absent = [r for r in peers if not store.check([f"host/{r}"])]
            raise SyncError(f"cuda_ipc transport, rank {rank}: ranks {absent} did not connect within "
                            f"{timeout_s:g}s") from exc
        check_colocated(routes, {r: store.get(f"host/{r}").decode() for r in peers})
        self._routes = set(routes)
        self._connected(store, rank, world_size, master_addr, master_port)

    def run(self, plan: SyncPlan, rank: int, get_region: GetRegion | None = None,
            on_bucket: OnBucket | None = None, recv_into: RecvInto | None = None) -> SyncStats:
        """As ``Transport.run``; ``recv_into`` is not used (receivers copy straight out of the source's buffer)."""
        check_run(plan, rank, self._rank, self._routes, get_region, self._failed)
        self._runs += 1
        prefix = f"run/{self._runs}/"
        order = rank_schedule(plan, rank)
        self._ensure_slots(max((plan.buckets[i].nbytes for i in order if plan.buckets[i].src == rank), default=0))
        start = time.perf_counter()
        unacked: deque[int] = deque()  # buckets this rank sent whose slots are still being read
        sent = received = sends = 0
        try:
            for index in order:
                bucket = plan.buckets[index]
                if bucket.src == rank:
                    if len(unacked) == self.window:
                        self._await_acks(prefix, plan, unacked.popleft())
                    buffer, handle = self._slots[sends % self.window]
                    pack_bucket(bucket, plan.meta, get_region, buffer)
                    self._shared.ready()
                    self._store.set(f"{prefix}bucket/{index}", handle)
                    unacked.append(index)
                    sends += 1
                    sent += bucket.nbytes
                else:
                    handle = self._await(f"{prefix}bucket/{index}", index, plan, f"source rank {bucket.src}")
                    buffer = self._shared.open(handle)[:bucket.nbytes]
                    if on_bucket is not None:
                        on_bucket(bucket, unpack_bucket(bucket, plan.meta, buffer))
                    self._shared.ready()
                    self._store.set(f"{prefix}ack/{index}/{rank}", b"1")
                    received += bucket.nbytes
            while unacked:
                self._await_acks(prefix, plan, unacked.popleft())
        except SyncError as exc:
            self._failed = str(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - packing / on_bucket failures end the sync the same way
            self._failed = f"rank {rank}: {exc}"
            raise SyncError(f"weight sync (cuda_ipc) failed on rank {rank}: {type(exc).__name__}: {exc}") from exc
        return SyncStats(sent, received, time.perf_counter() - start, len(order))

    def close(self) -> None:
        self._leave()
        self._slots = []
        self._shared.release()
        self._routes = set()

    # ------------------------------------------------------------------ internals

    def _ensure_slots(self, nbytes: int) -> None:
        """``window`` shared buffers of at least ``nbytes`` (none on a rank that sends nothing)."""
        if nbytes == 0 or (self._slots and self._slots[0][0].numel() >= nbytes):
            return
        self._shared.release()
        self._slots = [self._shared.allocate(nbytes) for _ in range(self.window)]

    def _await(self, key: str, index: int, plan: SyncPlan, who: str) -> bytes:
        try:
            self._store.wait([key], self._timeout)
        except Exception as exc:  # noqa: BLE001 - the store raises on timeout
            bucket = plan.buckets[index]
            peers = [r for r in members((bucket.src, bucket.dsts)) if r != self._rank]
            raise SyncError(f"weight sync (cuda_ipc) on rank {self._rank}: bucket {index} of route {bucket.src} -> "
                            f"{list(bucket.dsts)} not published by {who} within {self._timeout.total_seconds():g}s "
                            f"(peer ranks {peers}){describe_silent(self._store, peers)}") from exc
        return self._store.get(key)

    def _await_acks(self, prefix: str, plan: SyncPlan, index: int) -> None:
        bucket = plan.buckets[index]
        keys = [f"{prefix}ack/{index}/{d}" for d in bucket.dsts]
        try:
            self._store.wait(keys, self._timeout)
        except Exception as exc:  # noqa: BLE001
            missing = [d for d, k in zip(bucket.dsts, keys) if not self._store.check([k])]
            raise SyncError(f"weight sync (cuda_ipc) on rank {self._rank}: bucket {index} of route {bucket.src} -> "
                            f"{list(bucket.dsts)} not acknowledged by peer ranks {missing} within "
                            f"{self._timeout.total_seconds():g}s{describe_silent(self._store, missing)}") from exc
        for key in [f"{prefix}bucket/{index}", *keys]:
            self._store.delete_key(key)
