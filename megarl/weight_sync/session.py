"""The controller's view of weight sync: plan once, then ``sync(version)`` after every step.

    session = WeightSyncSession(cfg, trainer_workers, fleet)   # plan + connect (once)
    metrics = session.sync(version)                             # every step
    session.close()

Set-up: every trainer rank reports the regions of HF tensors it holds (metadata only); the
rollout side's needs come from vLLM's TP split of each tensor, which the model family declares
(``megarl.models.vllm_splits``, applied in ``rollout_layout``); the planner computes
one plan, checked for exact coverage, which every participant receives. Trainer rank 0 hosts the
rendezvous; trainer ranks are sync ranks ``0..T-1`` and the vLLM workers follow, replica by
replica. ``sync`` starts the senders and the receivers together and waits for all of them: a
failure anywhere raises ``SyncError`` (the replicas that did not finish refuse to generate until
a later sync succeeds), and every wait is bounded by ``rollout.weight_sync.timeout_s``.
"""
from __future__ import annotations

import logging
import time

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.planner import Piece, TensorMeta, plan_sync
from megarl.weight_sync.rollout_layout import RolloutLayout, rollout_needs

logger = logging.getLogger(__name__)

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def choose_transport(name: str, use_gpu: bool) -> str:
    if name == "auto":
        return "nccl" if use_gpu else "gloo"
    if name in ("nccl", "cuda_ipc") and not use_gpu:
        raise ValueError(f"actor_rollout_ref.rollout.weight_sync.transport={name!r} needs GPUs; use gloo or auto")
    return name


class WeightSyncSession:
    def __init__(self, cfg, workers, fleet):
        import ray

        from megarl.models import hf_tensor_shapes, vllm_splits

        sync_cfg = cfg.actor_rollout_ref.rollout.weight_sync
        self.timeout_s = float(sync_cfg.timeout_s)
        self.workers, self.fleet = workers, fleet
        model_path = cfg.actor_rollout_ref.model.path
        start = time.perf_counter()

        reports = workers.call("sync_sources")
        sources, dtypes = [], {}
        for rank, report in enumerate(reports):
            dtypes.update(report["dtypes"])
            sources += [Piece(rank, name, region) for name, regions in report["regions"].items() for region in regions]
        shapes = {name: tuple(shape) for name, shape in hf_tensor_shapes(model_path).items()}
        mode = "full" if not fleet.use_gpu else "shard"
        layout = RolloutLayout(fleet.num_replicas, int(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size),
                               mode=mode, first_rank=workers.world_size)
        needs = rollout_needs(shapes, layout, vllm_splits(model_path))
        meta = {name: TensorMeta(shape, _ITEMSIZE[dtypes.get(name, "float32")], dtypes.get(name, "float32"))
                for name, shape in shapes.items()}
        self.plan = plan_sync(sources, needs, meta, bucket_bytes=int(sync_cfg.bucket_mb) << 20)
        self.plan.check()
        self.layout = layout
        world = workers.world_size + len(layout.ranks)
        transport = choose_transport(sync_cfg.transport, fleet.use_gpu)
        self.transport, self.mode = transport, mode
        addr, port = ray.get(workers.actors[0].sync_address.remote())
        plan_ref = ray.put(self.plan)
        refs = [a.sync_connect.remote(plan_ref, world, addr, port, transport, self.timeout_s) for a in workers.actors]
        refs += [r.sync_connect.remote(plan_ref, layout.first_rank, world, addr, port, transport, self.timeout_s)
                 for r in fleet.replicas]
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

    def sync(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        send = [a.sync_send.remote(version) for a in self.workers.actors]
        recv = [r.sync_receive.remote(version) for r in self.fleet.replicas]
        results = self._wait(send + recv, f"weight sync to version {version}")
        replicas = results[len(send):]
        versions = {r["version"] for r in replicas}
        if versions != {version}:
            raise SyncError(f"replicas report weight versions {sorted(versions)} after syncing version {version}")
        return {"weight_sync/seconds": time.perf_counter() - start,
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

    def close(self) -> None:
        import ray

        refs = [a.sync_close.remote() for a in self.workers.actors] + [r.sync_close.remote() for r in self.fleet.replicas]
        try:
            ray.get(refs, timeout=60)
        except Exception as exc:  # closing is best effort: the processes end next
            logger.warning("closing the weight-sync world: %s", exc)
