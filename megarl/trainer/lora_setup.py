"""LoRA in the Megatron worker: the model transform a role is built with, the adapter it starts from,
what its checkpoints record, and the adapter the fleet receives in adapter-only mode.

* ``build_transforms``: ``[LoRATransform]`` for a role with ``model.lora.rank > 0`` (and the
  TransformerConfig field that freezes DeepSeek-V3's router bias: the whole base is frozen);
* ``load_adapter``: ``model.lora.adapter_path``, a PEFT adapter directory or a megarl LoRA
  checkpoint (its adapters; the base comes from model.path as always);
* ``checkpoint_meta``: recorded in every LoRA checkpoint (the settings and the base model), so
  ``conversion megatron-to-hf`` can rebuild the merged model from it;
* ``adapter_update``: the actor's adapter in PEFT format on rank 0, for adapter-only updates.
"""
from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

ADAPTER_EXPORT_DIR = "lora_adapter"  # step_<N>/lora_adapter: the adapter in PEFT format


def build_transforms(settings, hf_path: str, overrides: dict) -> list:
    """The model transforms of a role (empty without LoRA); adds the override that freezes the router bias."""
    from megarl.models import model_dims
    from megarl.models.lora import LoRATransform

    if settings is None:
        return []
    moe = model_dims(hf_path).moe
    if moe is not None and moe.expert_bias:
        overrides["moe_router_bias_update_rate"] = 0.0  # the router bias is part of the frozen base
    return [LoRATransform(settings)]


def load_adapter(path: str, chunks: list, hf_path: str, layout, settings, role: str) -> None:
    """Start the adapters from ``adapter_path``: a PEFT directory, or a megarl LoRA checkpoint (any layout)."""
    from megarl.engine import load_checkpoint
    from megarl.models import default_transformer_impl
    from megarl.models.lora.peft import ADAPTER_CONFIG, load_peft_adapter

    folder = Path(path).expanduser()
    if (folder / ADAPTER_CONFIG).is_file():
        load_peft_adapter(chunks, folder, hf_path, layout, settings, role, default_transformer_impl())
    else:
        load_checkpoint(folder, chunks, load_rng=False)
    logger.info("%s: LoRA adapters loaded from %s", role, folder)


def checkpoint_meta(settings, base: dict) -> dict:
    """What a LoRA checkpoint records: ``{"lora": settings, "base": {"hf": path} or {"megatron": path}}``."""
    return {"lora": settings.to_dict(), "base": base}


def adapter_update(chunks: list, hf_path: str, layout, settings) -> dict | None:
    """``{"tensors": PEFT-named CPU tensors, "config": adapter_config}`` on rank 0, None elsewhere (collective)."""
    import torch.distributed as dist

    from megarl.models import default_transformer_impl, load_hf_config
    from megarl.models.lora.peft import gather_adapter_tensors, peft_config

    tensors = dict(gather_adapter_tensors(chunks, hf_path, layout, settings, "actor", default_transformer_impl()))
    if dist.get_rank() != 0:
        return None
    return {"tensors": tensors, "config": peft_config(settings, load_hf_config(hf_path), hf_path)}
