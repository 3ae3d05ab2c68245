"""One rollout rank's assembly of a sync: the HF tensors it needs, each region exactly once.

Independent of vLLM: the vLLM worker extension feeds ``WeightReceiver.receive(transport)`` straight
into ``model_runner.reload_weights(weights_iterator=...)``. Which weights version a replica serves,
and whether they are usable, is the replica's ``ReceiverEndpoint``'s to know
(``megarl.weight_sync.endpoints``): this object only assembles one sync and says whether it was
complete.

* For every HF tensor this rank needs, the receiver allocates one full-shape tensor (HF shape and
  dtype) and copies each arriving region into place. In full mode the whole tensor is needed; in
  shard mode only this worker's region is written (vLLM's loader reads only its shard; the rest
  stays uninitialised).
* A region that is one contiguous block of its tensor (whole tensors, row-split TP shards, the row
  chunks large tensors are split into) is received straight into place (``recv_into``) where the
  transport can (gloo sends region by region; nccl only for one-region buckets); only the other
  regions (column-split TP shards) are copied out of the transport's buffer.
* A tensor is handed out (``take_ready`` / yielded by ``receive``) as soon as all of it that this
  rank needs has arrived, and the receiver drops its reference, so memory holds only tensors in
  progress.
* ``recycle=True`` (for a consumer that is done with each tensor before it asks for the next,
  e.g. a loader that copies it into its parameters): a tensor the consumer is done with is reused for a later tensor of the
  same shape and dtype, in this sync and the next ones. Most model tensors share a few shapes, so
  a sync then allocates (and page-faults) almost nothing; the pool holds only as many tensors as
  were in progress at once.
* Exactly once: the plan's transfers to this rank must tile its needs (checked when the receiver
  is built); at run time every region must be one the plan sends here and arrive once. ``commit``
  raises a ``SyncError`` naming the tensors that did not arrive completely; a failed sync leaves
  the model with a mix of weights, which the endpoint records as stale.
"""
from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import Iterator

import torch

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.packing import as_bytes, is_contiguous_block, torch_dtype
from megarl.weight_sync.planner import Bucket, SyncPlan, Transfer
from megarl.weight_sync.regions import Region, contains, intersect, region_numel, to_slices
from megarl.weight_sync.transport.base import SyncStats, Transport

_DONE = object()


def _overlapping_pair(regions: list[Region]) -> tuple[Region, Region] | None:
    """Two of ``regions`` that overlap, or None (a sweep along dim 0)."""
    active: list[Region] = []
    for region in sorted(regions):
        active = [a for a in active if a[0][1] > region[0][0]]
        for other in active:
            if intersect(other, region) is not None:
                return other, region
        active.append(region)
    return None


class WeightReceiver:
    """Assembles the tensors that sync rank ``rank`` needs under ``plan``; see the module docstring."""

    def __init__(self, plan: SyncPlan, rank: int, device: torch.device | str = "cpu", recycle: bool = False) -> None:
        self.plan, self.rank, self.device, self.recycle = plan, rank, torch.device(device), recycle
        self._pool: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self._pool_lock = threading.Lock()
        self.last_stats: SyncStats | None = None
        self._needs: dict[str, list[Region]] = defaultdict(list)
        for piece in plan.needs:
            if piece.rank == rank:
                self._needs[piece.name].append(piece.region)
        self._expected: dict[tuple[str, Region], int] = {}
        duplicates = []
        for bucket in plan.buckets:
            if rank in bucket.dsts:
                for t in bucket.transfers:
                    if (t.name, t.region) in self._expected:
                        duplicates.append(f"{t.name}{list(t.region)}")
                    self._expected[(t.name, t.region)] = region_numel(t.region)
        self._check_plan_covers_needs(duplicates)
        self._pending = False
        self._tensors: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}
        self._arrived: set[tuple[str, Region]] = set()
        self._ready: list[str] = []

    @property
    def needed(self) -> dict[str, list[Region]]:
        return dict(self._needs)

    # ------------------------------------------------------------------ one sync, step by step
    @property
    def in_progress(self) -> bool:
        return self._pending

    def begin(self) -> None:
        """Start receiving one sync (an unfinished one is abandoned)."""
        self._pending = True
        self._tensors, self._filled, self._arrived, self._ready = {}, defaultdict(int), set(), []

    def on_bucket(self, bucket: Bucket, pieces: list[tuple[Transfer, torch.Tensor]]) -> None:
        """The transport's callback: copy each received region into its tensor."""
        if not self._pending:
            raise SyncError(f"rank {self.rank} got a bucket from rank {bucket.src} outside a sync; call begin() first")
        for transfer, data in pieces:
            key = (transfer.name, transfer.region)
            if key not in self._expected:
                raise SyncError(f"rank {self.rank} received {transfer.name}{list(transfer.region)} from rank "
                                f"{bucket.src}, which its plan does not send here; the sides use different plans")
            if key in self._arrived:
                raise SyncError(f"rank {self.rank} received {transfer.name}{list(transfer.region)} twice")
            self._arrived.add(key)
            target = self._tensor(transfer.name)[to_slices(transfer.region)]
            if target.data_ptr() != data.data_ptr():  # else it was received in place (recv_into)
                target.copy_(data)
            self._filled[transfer.name] += self._expected[key]
            if self._filled[transfer.name] == self._need_numel(transfer.name):
                self._ready.append(transfer.name)

    def recv_into(self, transfer: Transfer) -> torch.Tensor | None:
        """For a region that is a contiguous block of its tensor: that block's bytes, to receive in place."""
        if not self._pending:
            return None
        key = (transfer.name, transfer.region)
        if key not in self._expected or key in self._arrived:
            return None  # on_bucket reports the problem
        if not is_contiguous_block(transfer.region, self.plan.meta[transfer.name].shape):
            return None
        return as_bytes(self._tensor(transfer.name)[to_slices(transfer.region)])

    def take_ready(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors completed since the last call, handed over (the receiver keeps no reference)."""
        out = [(name, self._tensors.pop(name)) for name in self._ready]
        self._ready = []
        return out

    def commit(self) -> None:
        """Verify every needed region arrived exactly once; else raise (and abandon the sync)."""
        if not self._pending:
            raise SyncError(f"rank {self.rank}: commit() without a sync in progress")
        missing = {name: (self._filled.get(name, 0), self._need_numel(name)) for name in self._needs
                   if self._filled.get(name, 0) != self._need_numel(name)}
        if missing:
            listed = ", ".join(f"{n} ({got}/{need} elements)" for n, (got, need) in sorted(missing.items())[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            message = (f"rank {self.rank}: sync incomplete, {len(missing)} tensors missing: {listed}{more}; "
                       "the engine holds a mix of weights")
            self.fail()
            raise SyncError(message)
        self._pending = False
        self._tensors, self._arrived = {}, set()

    def fail(self) -> None:
        """Abandon the sync in progress."""
        self._pending = False
        self._tensors, self._ready = {}, []

    # ------------------------------------------------------------------ one sync, streamed
    def receive(self, transport: Transport) -> Iterator[tuple[str, torch.Tensor]]:
        """Run ``transport`` for this rank and yield ``(hf_name, tensor)`` as each tensor completes.

        The transport runs in a background thread, so unpacking and loading into the engine
        overlap the next buckets. After the last tensor the sync is committed; any failure (a
        transport error, a missing region) raises ``SyncError``; a consumer that stops early
        abandons the sync (nothing is committed).
        """
        self.begin()
        handoff: queue.Queue = queue.Queue()
        outcome: dict[str, object] = {}

        def on_bucket(bucket: Bucket, pieces: list[tuple[Transfer, torch.Tensor]]) -> None:
            self.on_bucket(bucket, pieces)
            for item in self.take_ready():
                handoff.put(item)

        def work() -> None:
            try:
                outcome["stats"] = transport.run(self.plan, self.rank, on_bucket=on_bucket, recv_into=self.recv_into)
            except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
                outcome["error"] = exc
            finally:
                handoff.put(_DONE)

        thread = threading.Thread(target=work, name=f"weight-sync-rx-{self.rank}", daemon=True)
        thread.start()
        committed = False
        try:
            while (item := handoff.get()) is not _DONE:
                yield item
                if self.recycle:  # the consumer asked for the next tensor: it is done with this one
                    self._give_back(item[1])
            thread.join()
            error = outcome.get("error")
            if error is not None:
                raise error if isinstance(error, SyncError) else SyncError(f"rank {self.rank}: {error}") from error
            self.commit()
            self.last_stats = outcome["stats"]
            committed = True
        finally:
            thread.join()  # ends by itself: every transport wait is bounded by its timeout
            if not committed and self._pending:  # (a failed commit has already failed itself)
                self.fail()

    # ------------------------------------------------------------------ internals
    def _tensor(self, name: str) -> torch.Tensor:
        """This sync's full-shape tensor for ``name``: on first use, a recycled one of its shape or a new one."""
        tensor = self._tensors.get(name)
        if tensor is None:
            meta = self.plan.meta[name]
            dtype = torch_dtype(meta, name)
            with self._pool_lock:
                free = self._pool.get((tuple(meta.shape), dtype))
                tensor = free.pop() if free else None
            if tensor is None:
                tensor = torch.empty(meta.shape, dtype=dtype, device=self.device)
            self._tensors[name] = tensor
        return tensor

    def _give_back(self, tensor: torch.Tensor) -> None:
        with self._pool_lock:
            self._pool[(tuple(tensor.shape), tensor.dtype)].append(tensor)

    def _need_numel(self, name: str) -> int:
        return sum(region_numel(r) for r in self._needs[name])

    def _check_plan_covers_needs(self, duplicates: list[str]) -> None:
        by_name: dict[str, list[Region]] = defaultdict(list)
        for name, region in self._expected:
            by_name[name].append(region)
        problems = [f"{d} is sent here twice" for d in duplicates[:4]]
        for name, regions in by_name.items():
            if name not in self._needs:
                problems.append(f"{name} is sent here but not needed")
                continue
            outside = [r for r in regions if not any(contains(n, r) for n in self._needs[name])]
            if outside:
                problems.append(f"{name}{list(outside[0])} lies outside this rank's need")
            if (pair := _overlapping_pair(regions)) is not None:
                problems.append(f"{name} regions {list(pair[0])} and {list(pair[1])} overlap")
        uncovered = [name for name in self._needs
                     if sum(region_numel(r) for r in by_name.get(name, [])) != self._need_numel(name)]
        if uncovered:
            more = f" and {len(uncovered) - 8} more" if len(uncovered) > 8 else ""
            problems.append(f"the plan does not deliver all of {sorted(uncovered)[:8]}{more}")
        if problems:
            raise SyncError(f"sync rank {self.rank}: the plan does not match this rank's needs: " + "; ".join(problems))
