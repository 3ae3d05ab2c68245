"""Qwen3-Next's and Qwen3.5's gated DeltaNet (linear attention) as a megatron module, in torch, for ``FamilySpec.decoder_spec``.

Why not megatron-core's ``megatron.core.ssm.gated_delta_net.GatedDeltaNet``: its constructor
refuses to build without the ``fla`` package (flash-linear-attention, CUDA/Triton only, not in
megarl's environment), its parameters are made on the current CUDA device, it refuses packed
sequences, and its fused ``in_proj`` orders q, k, v, z, b, a differently from the checkpoints. This
module keeps Hugging Face's parameters as they are (``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``,
``dt_bias``, ``A_log``, the gated ``norm``, ``out_proj``) and computes what transformers'
``Qwen3NextGatedDeltaNet`` computes, for a sequence ``x``:

* ``in_proj_qkvz`` gives per key head ``g`` [q_g, k_g, v_g (r value heads), z_g (r gates)] and
  ``in_proj_ba`` [b_g (r), a_g (r)], ``r`` = value heads per key head. Qwen3.5
  (``fused_projections=False``, transformers' ``Qwen3_5GatedDeltaNet``) has four unfused projections
  instead, each in flat head order: ``in_proj_qkv`` [q (all key heads); k; v (all value heads)],
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; the rest of the layer is the same;
* q, k, v (all heads) pass a causal depthwise conv1d (kernel ``linear_conv_kernel_dim``) and SiLU;
  q and k are L2-normalised per head and repeated to the value heads;
* ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32), and the gated delta rule
  ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t / sqrt(d_k)``,
  by megatron-core's pure-torch chunked kernel (``torch_chunk_gated_delta_rule``, chunks of 64);
* ``o`` per value head goes through an RMSNorm (weight, not zero-centred) times ``silu(z)``, then
  ``out_proj``.

Packed sequences (``PackedSeqParams``, THD) run sequence by sequence: the conv and the recurrence
restart at every ``cu_seqlens`` boundary, as HF restarts per row. Limits, refused with a message
when the model is built: tensor parallelism (the parameters are whole on every rank: the family's
``tp_problems`` refuses tp > 1 first), context parallelism, sequence parallelism. CUDA would run the
same torch code (no fla kernels are used): correct, not fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class GatedRMSNorm(torch.nn.Module):
    """``rmsnorm(x) * weight * silu(gate)`` with the norm in fp32 (HF ``Qwen3NextRMSNormGated``)."""

    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden = self.weight * hidden.to(dtype)
        return (hidden * F.silu(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNetLayer(MegatronModule):
    """The token mixer of a ``linear_attention`` layer, in the self-attention slot of megatron's
    ``TransformerLayer`` (see the module docstring); returns ``(output, None)`` like megatron's attention."""

    def __init__(self, config, layer_number: int, *, key_heads: int, value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel: int, fused_projections: bool = True, pg_collection=None, **kwargs):
        super().__init__(config=config)
        from megarl.platform import device as platform_device

        if config.tensor_model_parallel_size > 1 or config.context_parallel_size > 1:
            raise ValueError("megarl's gated DeltaNet layer (Qwen3-Next's linear attention) runs at tensor and context "
                             f"parallel size 1, got tp={config.tensor_model_parallel_size}, "
                             f"cp={config.context_parallel_size}; use pipeline or expert parallelism")
        if value_heads % key_heads:
            raise ValueError(f"linear_num_value_heads={value_heads} must be a multiple of linear_num_key_heads={key_heads}")
        self.layer_number = layer_number
        self.key_heads, self.value_heads, self.dk, self.dv = key_heads, value_heads, key_head_dim, value_head_dim
        self.ratio = value_heads // key_heads
        where, dtype = "cpu" if config.use_cpu_initialization else platform_device(), config.params_dtype
        hidden, key_dim, value_dim = config.hidden_size, key_heads * key_head_dim, value_heads * value_head_dim
        self.conv_dim = 2 * key_dim + value_dim

        def linear(rows: int, cols: int) -> torch.nn.Linear:
            layer = torch.nn.Linear(cols, rows, bias=False, device=where, dtype=dtype)
            if config.perform_initialization:
                config.init_method(layer.weight)
            return layer

        self.fused_projections = fused_projections
        if fused_projections:  # Qwen3-Next
            self.in_proj_qkvz = linear(2 * key_dim + 2 * value_dim, hidden)
            self.in_proj_ba = linear(2 * value_heads, hidden)
        else:  # Qwen3.5
            self.in_proj_qkv = linear(self.conv_dim, hidden)
            self.in_proj_z = linear(value_dim, hidden)
            self.in_proj_b = linear(value_heads, hidden)
            self.in_proj_a = linear(value_heads, hidden)
        self.conv1d = torch.nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False,
                                      padding=conv_kernel - 1, device=where, dtype=dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(value_heads, device=where, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(value_heads, device=where, dtype=dtype).uniform_(1, 16)))
        self.norm = GatedRMSNorm(value_head_dim, config.layernorm_epsilon, dtype, where)
        self.out_proj = linear(hidden, value_dim)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        """[s, b, hidden] (or packed [t, 1, hidden]) -> ([s, b, hidden], None)."""
        if attention_mask is not None:
            raise ValueError("the gated DeltaNet layer takes no attention mask (causal by construction)")
        x = hidden_states.transpose(0, 1)  # [b, s, h]
        if packed_seq_params is None:
            out = self._mix(x)
        else:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = (cu if cu is not None else packed_seq_params.cu_seqlens_q).tolist()
            if x.shape[0] != 1 or cu[-1] != x.shape[1]:
                raise ValueError(f"packed sequences: one row of {cu[-1]} tokens expected, got {tuple(x.shape[:2])}")
            out = torch.cat([self._mix(x[:, start:stop]) for start, stop in zip(cu[:-1], cu[1:]) if stop > start], 1)
        return out.transpose(0, 1).contiguous(), None

    def _split(self, x: torch.Tensor):
        """q, k [b, s, key heads, dk]; v, z [b, s, value heads, dv]; b, a [b, s, value heads]."""
        batch, seq = x.shape[:2]
        if not self.fused_projections:
            key_dim = self.key_heads * self.dk
            q, k, v = torch.split(self.in_proj_qkv(x), [key_dim, key_dim, self.value_heads * self.dv], dim=-1)
            heads = (batch, seq, self.value_heads)
            return (q.reshape(batch, seq, self.key_heads, self.dk), k.reshape(batch, seq, self.key_heads, self.dk),
                    v.reshape(*heads, self.dv), self.in_proj_z(x).reshape(*heads, self.dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        r, dk, dv = self.ratio, self.dk, self.dv
        qkvz = self.in_proj_qkvz(x).view(batch, seq, self.key_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(x).view(batch, seq, self.key_heads, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        heads = (batch, seq, self.value_heads)
        return q, k, v.reshape(*heads, dv), z.reshape(*heads, dv), b.reshape(heads), a.reshape(heads)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

        batch, seq = x.shape[:2]
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
        mixed = F.silu(self.conv1d(mixed)[..., :seq]).transpose(1, 2)
        key_dim = self.key_heads * self.dk
        q, k, v = torch.split(mixed, [key_dim, key_dim, self.value_heads * self.dv], dim=-1)
        q = l2norm(q.reshape(batch, seq, self.key_heads, self.dk))
        k = l2norm(k.reshape(batch, seq, self.key_heads, self.dk))
        v = v.reshape(batch, seq, self.value_heads, self.dv)
        if self.ratio > 1:
            q, k = q.repeat_interleave(self.ratio, dim=2), k.repeat_interleave(self.ratio, dim=2)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)
        out = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(out.reshape(batch, seq, -1))
