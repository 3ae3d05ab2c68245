"""The controller's view of weight sync: plan once, then ``sync()`` after every step.

    session = weight_updates(cfg, trainer_workers, fleet)   # megarl.settings.sync: plan + connect (once)
    metrics = session.sync()                                               # publishes version + 1
    session.close()

Set-up: every trainer rank reports the regions of HF tensors it holds (metadata only); the
rollout side's needs come from the engines' TP split of each tensor, which the fleet's backend
gives (``RolloutFleet.tensor_splits``: full tensors where the engines cannot take shards in place;
with the engines' expert parallelism, ``RolloutFleet.expert_parallel``, each expert only to its rank),
applied in ``rollout_layout``; the planner computes
one plan, checked for exact coverage, which every participant receives. Trainer rank 0 hosts the
rendezvous; trainer ranks are sync ranks ``0..T-1`` and the vLLM workers follow, replica by
replica (each replica's engine ranks). ``sync`` starts the senders (every rank's ``SenderEndpoint``) and the receivers (every
replica's ``ReceiverEndpoint``) together and waits for all of them: a failure anywhere raises
``SyncError`` (the replicas that did not finish refuse to generate until a later sync succeeds),
and every wait is bounded by ``rollout.weight_sync.timeout_s``. It talks to the two sides through
``WorkerGroup`` and ``RolloutFleet`` only. The session publishes the versions: ``version`` is the
last one every replica confirmed.

``leave_out``: prefixes of HF tensors the trainer does not change and the engines keep from their
checkpoint (a vision-language model's frozen vision tower, ``freeze_vision_tower``): they are not in
the plan, so nothing of them is sent.

When the fleet's members change (a replica lost, a replacement started: ``RolloutFleet.restore``),
the next ``sync`` first builds a new world for the members there are (a new plan and rendezvous;
the old world's store host waits for its live members to leave, not for the dead ones); the
replacements receive that sync, and then serve (``RolloutFleet.admit``).
"""
from __future__ import annotations

import logging
import time

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.planner import Piece, TensorMeta, plan_sync
from megarl.weight_sync.rollout_layout import RolloutLayout, rollout_needs
from megarl.weight_sync.transport import choose_transport

logger = logging.getLogger(__name__)

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class WeightSyncSession:
    """``workers``: the senders (a ``WorkerGroup`` whose ranks have ``sync_*`` methods, e.g. the
    Megatron workers); ``fleet``: the receivers. ``model_path`` gives the HF tensor shapes; ``leave_out``:
    HF name prefixes not synced (see the module docstring)."""

    def __init__(self, workers, fleet, model_path: str, *, bucket_mb: int = 512, transport: str = "auto",
                 timeout_s: float = 600.0, leave_out: tuple[str, ...] = ()):
        self.timeout_s = float(timeout_s)
        self.workers, self.fleet = workers, fleet
        self.model_path, self.bucket_mb, self.requested_transport = model_path, bucket_mb, transport
        self.leave_out = _checked_leave_out(model_path, leave_out)
        self.reconnects = 0
        self._connect()
        self.version = fleet.version()  # what the replicas serve now (0 for a fresh fleet)

    def _connect(self) -> None:
        """Plan the sync for the fleet's members now and connect every participant to a new world."""
        import ray

        from megarl.models import hf_tensor_shapes

        workers, fleet = self.workers, self.fleet
        start = time.perf_counter()
        self.membership = fleet.membership()

        reports = workers.call("sync_sources")
        sources, dtypes = [], {}
        for rank, report in enumerate(reports):
            dtypes.update(report["dtypes"])
            sources += [Piece(rank, name, region) for name, regions in report["regions"].items() for region in regions]
        shapes = {name: tuple(shape) for name, shape in hf_tensor_shapes(self.model_path).items()
                  if not name.startswith(self.leave_out)}
        splits = fleet.tensor_splits()
        mode = "full" if splits is None else "shard"
        layout = RolloutLayout(fleet.num_replicas, fleet.tensor_parallel_size, mode=mode, first_rank=workers.world_size,
                               expert_parallel=bool(getattr(fleet, "expert_parallel", False)))
        needs = rollout_needs(shapes, layout, splits or {})
        meta = {name: TensorMeta(shape, _ITEMSIZE[dtypes.get(name, "float32")], dtypes.get(name, "float32"))
                for name, shape in shapes.items()}
        self.plan = plan_sync(sources, needs, meta, bucket_bytes=int(self.bucket_mb) << 20)
        self.plan.check()
        self.layout = layout
        world = workers.world_size + len(layout.ranks)
        transport = choose_transport(self.requested_transport, fleet.use_gpu)
        self.transport, self.mode = transport, mode
        addr, port = workers.call_rank(0, "sync_address")
        plan_ref = ray.put(self.plan)
        refs = workers.call_async("sync_connect", plan_ref, world, addr, port, transport, self.timeout_s)
        for position in range(layout.replicas):  # each replica joins at its place among the members
            refs += fleet.call_async("sync_connect", plan_ref, layout.first_rank, world, addr, port, transport,
                                     self.timeout_s, position, replicas=[position])
        self._wait(refs, "connecting the weight-sync world")
        logger.info("weight sync: %s, %d trainer rank(s) -> %d replica(s) x TP=%d (%s mode), %d buckets, %.1f MB "
                    "per sync (minimum %.1f MB), set up in %.1f s", transport, workers.world_size, layout.replicas,
                    layout.tp, mode, len(self.plan.buckets), self.plan.bytes_sent / 2**20,
                    self.plan.bytes_needed() / 2**20 / max(1, layout.replicas), time.perf_counter() - start)

    def describe(self) -> str:
        """``gloo, full tensors, 1.6 MB in 1 bucket per step``: the plan in a few words."""
        what = "full tensors" if self.mode == "full" else "TP shards"
        buckets = len(self.plan.buckets)
        return (f"{self.transport}, {what}, {self.plan.bytes_sent / 2**20:.1f} MB in {buckets} "
                f"bucket{'s' if buckets != 1 else ''} per step")

    def resume_at(self, version: int) -> None:
        """Continue the version count of a resumed run (the next ``sync`` publishes ``version + 1``)."""
        self.version = max(self.version, int(version))

    def sync(self, in_flight: str = "wait") -> dict[str, float]:
        """Publish the trainer's weights as version ``self.version + 1``.

        ``in_flight``: what the replicas do with requests running when the sync starts: ``wait``
        (they finish on the old weights first) or ``abort`` (partial rollouts: they continue on
        the new weights after the sync, every token stamped with its version).
        """
        start = time.perf_counter()
        if self.fleet.membership() != self.membership:
            self._reconnect()
        version = self.version + 1
        send = self.workers.call_async("sync_send", version)
        recv = self.fleet.call_async("sync_receive", version, in_flight)
        results = self._wait(send + recv, f"weight sync to version {version}")
        replicas = results[len(send):]
        versions = {r["version"] for r in replicas}
        if versions != {version}:
            raise SyncError(f"replicas report weight versions {sorted(versions)} after syncing version {version}")
        self.version = version
        self.fleet.admit()  # replacements that just received the weights serve from now on
        return {"weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/drain_seconds": max(r["drain_seconds"] for r in replicas),
                "weight_sync/bytes_sent": float(sum(r["bytes"] for r in results[:len(send)])),
                "weight_sync/bytes_received": float(sum(r["bytes"] for r in replicas)),
                "weight_sync/version": float(version)}

    def _wait(self, refs, what: str) -> list:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s + 60)
        except ray.exceptions.GetTimeoutError as exc:
            raise SyncError(f"{what}: not finished after {self.timeout_s + 60:.0f} s") from exc
        except ray.exceptions.RayError as exc:
            raise SyncError(f"{what} failed: {exc}") from exc

    def _reconnect(self) -> None:
        """A new world for the fleet's members now (after a replica was lost or replaced)."""
        logger.info("weight sync: the rollout replicas changed (%s -> %s): connecting a new sync world",
                    [slot for slot, _ in self.membership], [slot for slot, _ in self.fleet.membership()])
        alive = set(self.fleet.membership())
        dead = sum(1 for member in self.membership if member not in alive) * self.layout.tp
        self.close(dead_ranks=dead)
        self._connect()
        self.reconnects += 1

    def close(self, dead_ranks: int = 0) -> None:
        """Leave the sync world; ``dead_ranks``: its ranks that died (a lost replica's), not waited for."""
        import ray

        try:
            ray.get(self.workers.call_async("sync_close", dead_ranks) + self.fleet.call_async("sync_close"),
                    timeout=60)
        except Exception as exc:  # closing is best effort: the processes end next
            logger.warning("closing the weight-sync world: %s", exc)


def _checked_leave_out(model_path: str, leave_out) -> tuple[str, ...]:
    """``leave_out`` as a tuple, each prefix naming at least one tensor of the checkpoint."""
    from megarl.models import hf_tensor_shapes

    leave_out = tuple(leave_out)
    if leave_out:
        names = hf_tensor_shapes(model_path)
        unmatched = [prefix for prefix in leave_out if not any(name.startswith(prefix) for name in names)]
        if unmatched:
            raise SyncError(f"weight sync: no tensor of {model_path} starts with {unmatched} (leave_out)")
    return leave_out
