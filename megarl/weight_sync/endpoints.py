"""The two ends of a weight sync, each one object with its life cycle and its state.

``SenderEndpoint`` lives in every trainer rank (``MegatronWorker.sync``): what the rank holds
(``sources``), its transport (``connect`` / ``send`` / ``close``). ``ReceiverEndpoint`` lives in
every rollout replica (``EngineReplica.weights``): its TP workers' transports, driven through the
engine's ``collective_rpc`` (``connect`` / ``receive`` / ``close``), and the one record of the
weights the replica serves: ``version`` (0: the checkpoint it started from; then the version of
the last complete sync) and ``stale`` (why the weights are not usable: a sync in progress or one
that failed; None when they are). Nothing else keeps a copy: the fleet asks the replicas, the
controller asks ``WeightSyncSession`` (which publishes the versions) through ``WorkerGroup`` and
``RolloutFleet``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

import torch

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.sender import LocalShards, region_reader

logger = logging.getLogger(__name__)


class SenderEndpoint:
    """Sync rank ``rank`` on the trainer side; ``shards()`` gives its current HF-named pieces
    (views into the live parameters, re-read at every send)."""

    def __init__(self, rank: int, shards: Callable[[], LocalShards]):
        self.rank, self.shards = rank, shards
        self.plan = None
        self.transport = None

    def sources(self) -> dict:
        """What this rank can send: ``{hf_name: [region, ...]}`` and each tensor's dtype (for the planner)."""
        shards = self.shards()
        return {"regions": {name: [region for region, _ in held] for name, held in shards.items()},
                "dtypes": {name: str(held[0][1].dtype).removeprefix("torch.") for name, held in shards.items()}}

    def connect(self, plan, world_size: int, master_addr: str, master_port: int, transport: str,
                timeout_s: float) -> None:
        from megarl.weight_sync.transport import make_transport

        self.close()
        self.plan = plan
        self.transport = make_transport(transport)
        self.transport.connect(self.rank, world_size, master_addr, master_port, plan, timeout_s)

    def send(self, version: int) -> dict:
        if self.transport is None:
            raise SyncError(f"trainer sync rank {self.rank}: send before connect")
        with torch.no_grad():
            stats = self.transport.run(self.plan, self.rank, get_region=region_reader(self.shards()))
        return {"seconds": stats.seconds, "bytes": stats.bytes_sent, "version": version}

    def close(self, dead_ranks: int = 0) -> None:
        """Leave the sync world; ``dead_ranks``: receivers of it that died (a lost replica's engine ranks),
        whom the store's host then does not wait for."""
        if self.transport is not None:
            if dead_ranks and hasattr(self.transport, "abandon"):
                self.transport.abandon("a rollout replica of this sync world was lost", dead_ranks)
            self.transport.close()
        self.transport = None


Rpc = Callable[..., Awaitable[list]]  # (method, *args) -> one result per TP worker


class ReceiverEndpoint:
    """Replica ``index``'s side; ``rpc(method, *args)`` runs a worker-extension method on its TP workers."""

    def __init__(self, index: int, rpc: Rpc):
        self.index, self.rpc = index, rpc
        self.version = 0
        self.stale: str | None = None
        self.ranks: list[int] = []

    def check_fresh(self) -> None:
        if self.stale:
            raise RuntimeError(f"replica {self.index} refuses to generate: {self.stale}. The fleet never serves "
                               "stale weights; a successful sync clears this.")

    async def connect(self, plan, first_rank: int, world_size: int, master_addr: str, master_port: int,
                      transport: str, timeout_s: float, position: int | None = None) -> list[int]:
        """Join the weight-sync world with every TP worker as the world's ``position``-th replica (default
        ``index``); return their sync ranks."""
        where = self.index if position is None else position
        self.ranks = await self.rpc("megarl_sync_connect", plan, first_rank, where, world_size, master_addr,
                                    master_port, transport, timeout_s)
        return self.ranks

    async def receive(self, version: int) -> dict[str, Any]:
        """One sharded sync into every TP worker. The weights are stale while it runs and stay stale
        (this replica refuses to generate) if it fails; ``version`` moves only when all of it arrived."""
        if version <= self.version:
            raise SyncError(f"replica {self.index}: sync version {version} is not newer than the version it "
                            f"serves ({self.version})")
        start = time.perf_counter()
        self.stale = f"weight sync to version {version} in progress"
        try:
            results = await self.rpc("megarl_sync_receive")
        except BaseException as exc:
            self.stale = f"weight sync to version {version} failed: {exc}"
            raise
        self.version, self.stale = int(version), None
        return {"seconds": time.perf_counter() - start, "bytes": sum(r["bytes"] for r in results),
                "version": self.version}

    async def close(self) -> None:
        try:
            await self.rpc("megarl_sync_close")
        finally:
            self.ranks = []
