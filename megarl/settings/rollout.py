"""The rollout fleet from the config: the typed ``actor_rollout_ref.rollout`` section (its backend
``name``, TP, replicas, sampling, engine arguments), the model and tokenizer paths, and what the
placement and LoRA imply (sleep mode when colocated with ``free_cache_engine``; an adapter-only
LoRA rank for the engine's LoRA support)."""
from __future__ import annotations

from typing import Any

from megarl.config.derived import adapter_only


def fleet_arguments(cfg: Any, plan) -> dict[str, Any]:
    """``RolloutFleet`` keyword arguments for the run's fleet (``plan``: the placement plan); the slots come
    from the placement."""
    from megarl.settings import typed_config
    from megarl.settings.engine import hf_config_overrides

    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    return dict(config=typed_config(cfg.actor_rollout_ref.rollout), model_path=str(model.path),
                tokenizer_path=model.tokenizer_path, trust_remote_code=bool(model.trust_remote_code),
                sleep_mode=plan.mode == "colocated" and bool(rollout.free_cache_engine),
                lora_rank=int(model.lora.rank) if adapter_only(cfg) else 0,
                hf_overrides=hf_config_overrides(cfg, "actor"),
                max_replica_failures=int(cfg.trainer.max_replica_failures))
