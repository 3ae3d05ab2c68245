"""Adapter-only weight updates: ``actor_rollout_ref.model.lora.merge=False`` (verl's default).

The fleet keeps the base model it loaded from ``model.path`` (the trainer's frozen base) and serves
it with the actor's LoRA adapter through vLLM's LoRA support; every sync sends only the adapter.
Same interface as ``WeightSyncSession`` (``version``, ``sync()`` -> metrics, ``resume_at``, ``close()``), chosen by
``megarl.settings.sync.weight_updates``:

1. the trainer ranks gather the adapter in PEFT format to rank 0 (the fused q/k/v and gate/up
   adapters split back per projection, ``megarl.models.lora.peft``);
2. it goes once into Ray's object store; every replica writes it to its own directory and swaps
   its ``LoRARequest`` (``megarl.rollout.vllm.adapters``), refusing to generate until that is done.

The adapter is a small fraction of the weights (``weight_sync/bytes_sent``: adapter bytes x
replicas), so it travels as one object instead of through the sharded transport.
``rollout/logprob_diff`` checks every step that the fleet serves the trainer's adapter.
"""
from __future__ import annotations

import logging
import time

from megarl.weight_sync.errors import SyncError

logger = logging.getLogger(__name__)


class AdapterUpdates:
    def __init__(self, workers, fleet, timeout_s: float = 600.0):
        self.workers, self.fleet, self.timeout_s = workers, fleet, timeout_s
        self.version = fleet.version()  # what the replicas serve now (0 for a fresh fleet)
        logger.info("weight sync: adapter-only (lora.merge=False): %d replica(s) serve model.path's base with the "
                    "actor's LoRA adapter through vLLM's LoRA", fleet.num_replicas)

    def describe(self) -> str:
        """The start-up line's few words on the sync (``WeightSyncSession.describe``'s counterpart)."""
        return f"LoRA adapter only, through Ray's object store to {self.fleet.num_replicas} replica(s) per step"

    def resume_at(self, version: int) -> None:
        """Continue the version count of a resumed run (the next ``sync`` publishes ``version + 1``)."""
        self.version = max(self.version, int(version))

    def sync(self, in_flight: str = "wait") -> dict[str, float]:
        """Publish the actor's adapter as version ``self.version + 1``. Replicas swap adapters between
        requests, so ``in_flight`` (partial rollouts) has no adapter-only form: only ``wait``."""
        import ray

        if in_flight != "wait":
            raise ValueError(f"in_flight={in_flight!r}: adapter-only updates (lora.merge=False) swap the adapter "
                             "between requests; partial rollouts need merged updates (lora.merge=True)")
        version = self.version + 1
        start = time.perf_counter()
        try:
            results = self.workers.call("lora_adapter")
            adapter = next(r for r in results if r is not None)
            reports = self.fleet.load_adapter(ray.put(adapter), version)
        except (ray.exceptions.RayError, StopIteration) as exc:
            raise SyncError(f"adapter update to version {version} failed: {exc}") from exc
        self.version = version
        self.fleet.admit()  # replacements that just loaded the adapter serve from now on
        sent = sum(t.numel() * t.element_size() for t in adapter["tensors"].values()) * len(reports)
        return {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/bytes_sent": float(sent),
                "weight_sync/bytes_received": float(sum(r["bytes"] for r in reports)),
                "weight_sync/version": float(version)}

    def close(self) -> None:
        pass
