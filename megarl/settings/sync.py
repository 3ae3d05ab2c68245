"""How the trainer's weights reach the fleet, from the config: ``actor_rollout_ref.rollout.weight_sync.*``
(``bucket_mb``, ``transport``, ``timeout_s``) and the LoRA merge choice (``actor_rollout_ref.model.lora``)."""
from __future__ import annotations

from typing import Any

from megarl.config.derived import adapter_only
from megarl.weight_sync.adapter_updates import AdapterUpdates
from megarl.weight_sync.session import WeightSyncSession


def weight_updates(cfg: Any, workers, fleet):
    """Merged weights through the sharded sync (``WeightSyncSession``), or, with LoRA and
    ``model.lora.merge=False``, the adapter alone (``AdapterUpdates``)."""
    sync = cfg.actor_rollout_ref.rollout.weight_sync
    if adapter_only(cfg):
        return AdapterUpdates(workers, fleet, float(sync.timeout_s))
    return WeightSyncSession(workers, fleet, cfg.actor_rollout_ref.model.path, bucket_mb=sync.bucket_mb,
                             transport=sync.transport, timeout_s=sync.timeout_s)
