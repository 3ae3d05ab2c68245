"""The transport interface: move a plan's buckets from source ranks to destination ranks.

Pluggable, as NeMo-RL's refit transports are: ``gloo`` (CPU, or GPU tensors staged on the host),
``nccl`` (GPU to GPU) and ``cuda_ipc`` (colocated trainer and rollout on one node) share this
interface, so the trainer and the rollout workers never depend on which one carries the bytes.

The sync world is its own: the trainer ranks (sync ranks ``0..T-1``, rank 0 = the first trainer
rank, which hosts the rendezvous store) plus the rollout workers (the following ranks, see
``RolloutLayout.first_rank``). They live in different processes and jobs and never join each
other's training process groups; they meet through a ``TCPStore`` on ``master_addr:master_port``, which
listens on that address only.

Life cycle, on every participant, in the same sequence::

    transport.connect(rank, world_size, master_addr, master_port, plan, timeout_s)
    stats = transport.run(plan, rank, get_region=..., on_bucket=...)   # once per RL step
    transport.close()

``run`` sends the buckets whose source is ``rank`` (packing them with ``get_region``) and
receives those it is a destination of (handing each, unpacked, to ``on_bucket``; ``recv_into``
may offer the final memory of a region so that it lands in place). Every wait is
bounded by ``timeout_s``; a failure raises ``SyncError`` naming the bucket, route and peers.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from megarl.platform import network
from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.packing import GetRegion
from megarl.weight_sync.planner import Bucket, SyncPlan, Transfer
from megarl.weight_sync.schedule import Route, routes_of

OnBucket = Callable[[Bucket, list[tuple[Transfer, torch.Tensor]]], None]
"""Called on a destination with each received bucket and its per-transfer tensors (views into a
reused buffer: copy what you keep before returning)."""

RecvInto = Callable[[Transfer], "torch.Tensor | None"]
"""Optional, on a destination: a flat ``uint8`` tensor of ``transfer.nbytes`` to receive that
region straight into (its final place, so no unpacking copy is needed), or None for the
transport's own buffer. ``on_bucket`` is still called, with typed views of wherever it landed."""


@dataclass(frozen=True)
class SyncStats:
    """What one ``run`` moved on one rank."""

    bytes_sent: int  # bytes of buckets this rank was the source of (each once, whatever the fan-out)
    bytes_received: int
    seconds: float
    buckets: int  # buckets this rank took part in


class Transport(abc.ABC):
    """Moves buckets between the ranks of a sync world; see the module docstring."""

    name = "transport"

    @abc.abstractmethod
    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, plan: SyncPlan,
                timeout_s: float = 300.0) -> None:
        """Join the sync world and set up what ``plan``'s buckets involving ``rank`` need."""

    @abc.abstractmethod
    def run(self, plan: SyncPlan, rank: int, get_region: GetRegion | None = None,
            on_bucket: OnBucket | None = None, recv_into: RecvInto | None = None) -> SyncStats:
        """Send and receive every bucket of ``plan`` that ``rank`` takes part in."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release communicators, buffers and the store connection; safe to call twice."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StoreTransport(Transport):
    """A transport whose participants meet through the sync store (every one here): the connection
    state, the window of buckets in flight, the heartbeat and the leaving protocol. A subclass's
    ``connect`` calls ``_join`` (the store), sets up what it needs, then ``_connected``; its ``close``
    releases its own resources and calls ``_leave``."""

    def __init__(self, window: int = 2) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (2 = double-buffered), got {window}")
        self.window = window
        self._rank: int | None = None
        self._world_size = 0
        self._store: dist.TCPStore | None = None
        self._heartbeat = None  # liveness.Heartbeat while connected
        self._timeout = timedelta(seconds=300)
        self._failed: str | None = None  # what broke an earlier run: the transport refuses further runs
        self._dead = 0  # ranks of this world known dead (abandon): the store's host does not wait for them

    def _join(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> dist.TCPStore:
        """The sync world's store, for a transport not connected yet."""
        if self._rank is not None:
            raise SyncError(f"transport already connected as rank {self._rank}; close() it first")
        self._timeout = timedelta(seconds=timeout_s)
        return rendezvous(rank, world_size, master_addr, master_port, timeout_s)

    def _connected(self, store: dist.TCPStore, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        from megarl.weight_sync.transport.liveness import Heartbeat

        self._store, self._rank, self._world_size = store, rank, world_size
        self._heartbeat = Heartbeat(master_addr, master_port, rank)

    def abandon(self, reason: str, dead_ranks: int) -> None:
        """``dead_ranks`` peers of this world died (a lost rollout replica): ``close`` then waits only for
        the others to leave, at most briefly, as after a failed sync."""
        self._failed = self._failed or reason
        self._dead = int(dead_ranks)

    def _leave(self) -> None:
        """Stop the heartbeat and leave the store (its host waits for the others); safe to call twice."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._heartbeat = None
        if self._rank is not None:
            leave(self._store, self._rank, self._world_size - self._dead, self._leave_wait_s())
        self._store, self._rank, self._failed, self._dead = None, None, None, 0

    def _leave_wait_s(self) -> float:
        """The store host waits for everyone after a good sync, briefly after a failed one (dead ranks never leave)."""
        from megarl.weight_sync.transport.liveness import FAILURE_GRACE_S

        timeout = self._timeout.total_seconds()
        return min(timeout, FAILURE_GRACE_S) if self._failed else timeout


def rendezvous(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> dist.TCPStore:
    """The sync world's store: rank 0 hosts it, listening on ``master_addr`` only (``platform.network``;
    a port ``reserve_port`` holds there, or ``master_port``), the others connect (retrying until ``timeout_s``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"sync rank {rank} is outside the sync world of {world_size} ranks")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    try:
        return network.tcp_store(master_addr, int(master_port), world_size, rank == 0, timeout_s)
    except Exception as exc:  # noqa: BLE001 - re-raised with the address and role
        role = "host" if rank == 0 else "reach"
        raise SyncError(f"sync rank {rank} could not {role} the weight-sync store at {master_addr}:{master_port} "
                        f"within {timeout_s:g}s: {exc}") from exc


def check_run(plan: SyncPlan, rank: int, connected_rank: int | None, connected_routes: set[Route],
              get_region: GetRegion | None, failed: str | None) -> None:
    """Reject a ``run`` that cannot work, before any byte moves."""
    if failed:
        raise SyncError(f"this transport failed in an earlier sync ({failed}); close() it and connect() again")
    if connected_rank is None:
        raise SyncError("run() before connect(): connect every participant with the plan first")
    if rank != connected_rank:
        raise SyncError(f"run(rank={rank}) on a transport connected as rank {connected_rank}")
    missing = [r for r in routes_of(plan, rank) if r not in connected_routes]
    if missing:
        raise SyncError(f"rank {rank}: the plan uses routes {missing[:4]} that connect() did not set up; "
                        f"connect again with this plan")
    if get_region is None and any(b.src == rank for b in plan.buckets):
        raise SyncError(f"rank {rank} is the source of buckets in this plan but run() got no get_region")


def leave(store: dist.Store | None, rank: int, world_size: int, wait_s: float) -> None:
    """Announce that ``rank`` is done with the store; rank 0, its host, keeps it up until ``world_size``
    ranks (all, or all but the known dead) have left.

    Without this, rank 0 finishing early would take the store away from ranks still connecting,
    exchanging handles (cuda_ipc) or diagnosing a failure. Rank 0 waits at most ``wait_s``.
    """
    if store is None:
        return
    try:
        store.add("left", 1)
        deadline = time.monotonic() + wait_s
        while rank == 0 and store.add("left", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is already gone: nothing left to keep up
        return
