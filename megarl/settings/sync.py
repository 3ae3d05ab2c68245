"""How the trainer's weights reach the fleet, from the config: ``actor_rollout_ref.rollout.weight_sync.*``
(``bucket_mb``, ``transport``, ``timeout_s``) and the LoRA merge choice (``actor_rollout_ref.model.lora``)."""
from __future__ import annotations

from typing import Any

from megarl.config.derived import adapter_only
from megarl.weight_sync.adapter_updates import AdapterUpdates
from megarl.weight_sync.session import WeightSyncSession


def weight_updates(cfg: Any, workers, fleet):
    """Merged weights through the sharded sync (``WeightSyncSession``), or, with LoRA and
    ``model.lora.merge=False``, the adapter alone (``AdapterUpdates``). With ``actor.freeze_vision_tower``
    (a vision-language model whose tower the trainer does not train) the tower is left out of the sync: the
    engines keep the checkpoint's, which the frozen tower equals."""
    sync = cfg.actor_rollout_ref.rollout.weight_sync
    if adapter_only(cfg):
        return AdapterUpdates(workers, fleet, float(sync.timeout_s))
    path = cfg.actor_rollout_ref.model.path
    return WeightSyncSession(workers, fleet, path, bucket_mb=sync.bucket_mb, transport=sync.transport,
                             timeout_s=sync.timeout_s, leave_out=frozen_tensors(path, bool(cfg.actor_rollout_ref.actor.freeze_vision_tower)))


def frozen_tensors(model_path: str, freeze_vision_tower: bool) -> tuple[str, ...]:
    """The HF name prefixes the sync leaves out: the vision tower's when it is frozen (refused for a text model)."""
    if not freeze_vision_tower:
        return ()
    from megarl.models import model_dims

    vision = model_dims(model_path).vision
    if vision is None:
        raise ValueError(f"freeze_vision_tower: {model_path} is not a vision-language model (it has no vision tower)")
    return (vision.hf_prefix,)
