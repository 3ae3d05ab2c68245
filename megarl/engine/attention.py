"""Causal self-attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local layer spec (used without Transformer Engine, e.g. on every CPU machine)
computes attention unfused: it materialises the ``[b, heads, s, s]`` scores, masks them, takes a
softmax and multiplies by the values, in both forward and backward. On CPU that is ~4x the time
of torch's fused SDPA kernel, and about half of the model's forward time at sequence length 256.

The engine always runs causal attention without a mask tensor (``packing`` left-aligns every
row), which is exactly SDPA's ``is_causal=True``. ``use_sdpa_attention`` swaps each local-spec
``DotProductAttention`` for ``CausalSDPA``; the result equals megatron's to float rounding
(the engine tests compare with Hugging Face within 1e-5). Anything SDPA cannot express (a mask
tensor, an attention bias, packed sequences) falls back to megatron's module; models with a
sliding window, a non-vanilla softmax or fp16 layer-number scaling keep megatron's attention.
Transformer Engine's fused attention is left alone.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


class CausalSDPA(torch.nn.Module):
    """Megatron's core-attention call signature, computed by torch's fused causal SDPA."""

    def __init__(self, megatron_attention: torch.nn.Module):
        super().__init__()
        self.megatron_attention = megatron_attention  # the fallback; holds no parameters
        config = megatron_attention.config
        self.softmax_scale = megatron_attention.softmax_scale
        self.dropout = config.attention_dropout
        self.sequence_parallel = config.sequence_parallel
        self.heads_per_group = megatron_attention.num_attention_heads_per_partition // megatron_attention.num_query_groups_per_partition
        self.hidden_per_partition = megatron_attention.hidden_size_per_partition

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            return self.megatron_attention(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        from megatron.core import tensor_parallel

        seq, batch = query.shape[0], query.shape[1]
        if self.heads_per_group > 1:  # grouped-query attention: each KV head serves a group of query heads
            key = key.repeat_interleave(self.heads_per_group, dim=2)
            value = value.repeat_interleave(self.heads_per_group, dim=2)
        # megatron's [s, b, heads, head_dim] -> SDPA's [b, heads, s, head_dim]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout if self.training else 0.0
        if dropout and not self.sequence_parallel:  # as megatron: model-parallel RNG for dropout
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=self.softmax_scale)
        else:
            context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_per_partition)


def use_sdpa_attention(model_chunks: Sequence[torch.nn.Module]) -> int:
    """Replace every plain-softmax megatron ``DotProductAttention`` in the chunks; returns how many."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    replaced = 0
    for chunk in model_chunks:
        for module in list(chunk.modules()):
            core = getattr(module, "core_attention", None)
            if isinstance(core, DotProductAttention) and _plain_causal_softmax(core.config):
                module.core_attention = CausalSDPA(core)
                replaced += 1
    return replaced


def _plain_causal_softmax(config) -> bool:
    """No sliding window, no learnable/offset softmax, no fp16 layer-number scaling of the scores."""
    return (
        getattr(config, "softmax_type", "vanilla") == "vanilla"
        and getattr(config, "window_size", None) is None
        and not getattr(config, "apply_query_key_layer_scaling", False)
    )
