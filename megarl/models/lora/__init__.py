"""LoRA on the Megatron engine: adapters on megatron-core's parallel linears, one model transform.

    from megarl.models.lora import LoRASettings, LoRATransform, adapters_disabled
    chunks = build_model(path, layout, "actor", transforms=[LoRATransform(LoRASettings(rank=16, alpha=32))])
    with adapters_disabled(chunks):   # the base model: the reference policy, no second model
        ...

Modules, one concept each:
  settings   LoRASettings (verl's keys) and which HF projections of which linears the targets select
  shards     where each adapter tensor lives on each rank and which PEFT tensors it holds (pure)
  layers     the adapter forward on a parallel linear (TP / SP / experts), the off switch, checkpoint sharding
  transform  LoRATransform: attach and initialise the adapters, freeze the base
  merge      the merged weight W + alpha/r * B A as the export and the weight sync read it (fp32, lazily)
  peft       the adapter in PEFT format (adapter_config.json + adapter_model.safetensors), both ways
"""
from megarl.models.lora.layers import LoRALinear, adapted_linears, adapters_disabled
from megarl.models.lora.merge import MergedWeight, exported_tensor, region
from megarl.models.lora.settings import ALL_LINEAR, MEGATRON_LINEARS, LoRASettings
from megarl.models.lora.shards import AdapterSpec, lora_parameter_count, lora_shards, peft_name, selection
from megarl.models.lora.transform import LoRATransform, adapter_parameters, has_adapters

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (chunk-local or global) is an adapter tensor."""
    return name.endswith(ADAPTER_SUFFIXES)


__all__ = [
    "ADAPTER_SUFFIXES",
    "ALL_LINEAR",
    "AdapterSpec",
    "LoRALinear",
    "LoRASettings",
    "LoRATransform",
    "MEGATRON_LINEARS",
    "MergedWeight",
    "adapted_linears",
    "adapter_parameters",
    "adapters_disabled",
    "exported_tensor",
    "has_adapters",
    "is_adapter_param",
    "lora_parameter_count",
    "lora_shards",
    "peft_name",
    "region",
    "selection",
]
