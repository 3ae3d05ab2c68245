"""TransformerConfig flags that depend on the platform.

Megatron-core's fused kernels (softmax, bias+dropout, bias+activation, RoPE, MoE permute/router)
and GPU-side weight init need CUDA. Model builders apply ``transformer_config_overrides()`` to
every TransformerConfig they make. Grouped-GEMM experts (``moe_grouped_gemm=True``) stay the
caller's choice: on CPU they are megatron's legacy ``GroupedMLP`` (the local layer spec's, with
``moe_use_legacy_grouped_gemm`` saying so for every spec) over the CPU stand-in of the
``grouped_gemm`` package (``cpu_compat``'s ``grouped_gemm`` redirect).
"""

import dataclasses

from megarl.platform import hardware

# What a CPU run needs: initialise weights on CPU and use the plain torch ops instead of fused kernels.
_CPU_OVERRIDES = {
    "use_cpu_initialization": True,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "bias_activation_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
    "moe_use_legacy_grouped_gemm": True,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
}


def cpu_transformer_config_overrides() -> dict:
    """The CPU flags, limited to the fields the installed TransformerConfig has."""
    from megatron.core.transformer import TransformerConfig

    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    return {name: value for name, value in _CPU_OVERRIDES.items() if name in fields}


def transformer_config_overrides() -> dict:
    """Flags to apply on this machine: the CPU flags without CUDA, nothing (megatron's defaults) with it."""
    return {} if hardware.has_cuda() else cpu_transformer_config_overrides()
