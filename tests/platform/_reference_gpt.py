"""The tiny GPT written out in plain torch: an independent reference for megatron-core's logits.

Reads a full (TP=1) megatron GPTModel state dict. Layout facts it relies on, from megatron-core:
``linear_qkv`` rows are grouped per query group as [q heads of the group, k, v]; RoPE is the
non-interleaved (rotate-half) form; ``linear_fc1`` of a gated MLP is [gate; up]; embeddings are
tied to the output layer.
"""

import math

import torch
import torch.nn.functional as F


def _rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(x, positions, base=10000.0):
    """x: [batch, heads, seq, head_dim]; positions: [seq]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(positions.float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return x * angles.cos() + _rotate_half(x) * angles.sin()


def reference_logits(state, tokens, num_layers, num_heads):
    """Logits [batch, seq, vocab] of the tiny GPT for ``tokens`` [batch, seq]."""
    embedding = state["embedding.word_embeddings.weight"]
    hidden = embedding[tokens]  # [b, s, h]
    batch, seq, width = hidden.shape
    head_dim = width // num_heads
    positions = torch.arange(seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    for layer in range(num_layers):
        prefix = f"decoder.layers.{layer}."
        x = _rms_norm(hidden, state[prefix + "input_layernorm.weight"])
        qkv = x @ state[prefix + "self_attention.linear_qkv.weight"].T  # [b, s, heads*3*d]
        qkv = qkv.view(batch, seq, num_heads, 3 * head_dim).transpose(1, 2)  # [b, heads, s, 3d]
        q, k, v = qkv.split(head_dim, dim=-1)
        q, k = _rope(q, positions), _rope(k, positions)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        attention = attention.transpose(1, 2).reshape(batch, seq, width)
        hidden = hidden + attention @ state[prefix + "self_attention.linear_proj.weight"].T
        x = _rms_norm(hidden, state[prefix + "pre_mlp_layernorm.weight"])
        gate, up = (x @ state[prefix + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
        hidden = hidden + (F.silu(gate) * up) @ state[prefix + "mlp.linear_fc2.weight"].T
    hidden = _rms_norm(hidden, state["decoder.final_layernorm.weight"])
    return hidden @ embedding.T
