"""Attention for megatron-core's local layer spec: one core-attention module (``CoreAttention``) that
computes exact causal attention over padded rows and packed sequences, across context-parallel
ranks, with sliding windows, logit soft-capping and attention sinks (see ``core``).

  kernels           torch's fused SDPA where exact; the blockwise kernel (own backward) elsewhere
  context_parallel  which tokens a CP rank holds; the all-gather of keys/values and its backward
  core              the megatron module, and ``use_core_attention`` for a layer spec
"""
from megarl.models import lazy_exports

# Imported on first use (PEP 562): the engine's packing needs the CP layout without megatron-core.
_HOMES = {
    "CoreAttention": "megarl.models.attention.core",
    "PackedLayout": "megarl.models.attention.context_parallel",
    "blockwise_attention": "megarl.models.attention.kernels",
    "gather_packed_row": "megarl.models.attention.context_parallel",
    "packed_layout": "megarl.models.attention.context_parallel",
    "sdpa_causal": "megarl.models.attention.kernels",
    "sdpa_causal_segments": "megarl.models.attention.kernels",
    "use_core_attention": "megarl.models.attention.core",
}


__getattr__ = lazy_exports(__name__, _HOMES)


__all__ = sorted(_HOMES)
