"""Qwen3-Next's and Qwen3.5's gated DeltaNet (linear attention) as a megatron module, in torch, for ``FamilySpec.decoder_spec``.

Why not megatron-core's ``megatron.core.ssm.gated_delta_net.GatedDeltaNet``: its constructor
refuses to build without the ``fla`` package (flash-linear-attention, CUDA/Triton only, not in
megarl's environment), its parameters are made on the current CUDA device, it refuses packed
sequences, and its fused ``in_proj`` orders q, k, v, z, b, a differently from the checkpoints. This
module keeps Hugging Face's parameters (``in_proj_qkvz``, ``in_proj_ba``, ``dt_bias``, ``A_log``, the gated
``norm``, ``out_proj``) and computes what transformers' ``Qwen3NextGatedDeltaNet`` computes, for a sequence ``x``:

* ``in_proj_qkvz`` gives per key head ``g`` [q_g, k_g, v_g (r value heads), z_g (r gates)] and
  ``in_proj_ba`` [b_g (r), a_g (r)], ``r`` = value heads per key head. Qwen3.5
  (``fused_projections=False``, transformers' ``Qwen3_5GatedDeltaNet``) has four unfused projections
  instead: ``in_proj_qkv`` [q (all key heads); k; v (all value heads)], ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` (value heads in order: head j belongs to key head j // r); the rest of the layer is the same;
* q, k, v pass a causal depthwise conv1d (kernel ``linear_conv_kernel_dim``) and SiLU;
  q and k are L2-normalised per head and repeated to the value heads;
* ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32), and the gated delta rule
  ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t / sqrt(d_k)``,
  by megatron-core's pure-torch chunked kernel (``torch_chunk_gated_delta_rule``, chunks of 64);
* ``o`` per value head goes through an RMSNorm (weight, not zero-centred) times ``silu(z)``, then
  ``out_proj``.

Tensor parallelism splits the heads: a TP rank holds whole key heads and their value heads (the key heads must
divide by TP). The depthwise conv's channels, [q; k; v] in flat head order in the checkpoint, are held per key
head here, [q_g; k_g; v_g] for each of the rank's key heads g, so that a rank's share is one contiguous range in
every layout: ``conv1d_grouped`` (and Qwen3.5's ``in_proj_qkv_grouped``) are HF's ``conv1d`` (``in_proj_qkv``)
with their rows in that order (``megarl.models.mappings.HeadGroups``). The input projections are column-parallel,
``out_proj`` row-parallel (its partial sums all-reduced, or reduce-scattered under sequence parallelism, whose
sequence shards are gathered on the way in); the gated norm's weight, shared by every head, gets its gradient
summed over the TP ranks. Packed sequences (``PackedSeqParams``, THD) run sequence by sequence: the conv and the
recurrence restart at every ``cu_seqlens`` boundary, as HF restarts per row. Context parallelism is refused when
the model is built. CUDA would run the same torch code (no fla kernels are used): correct, not fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class GatedRMSNorm(torch.nn.Module):
    """``rmsnorm(x) * weight * silu(gate)`` with the norm in fp32 (HF ``Qwen3NextRMSNormGated``). Under TP each rank
    normalises its own heads with the one weight: ``shared_over_tp`` sums its gradient over the TP ranks."""

    def __init__(self, size: int, eps: float, dtype, device, shared_over_tp: bool = False):
        super().__init__()
        self.eps, self.shared_over_tp = eps, shared_over_tp
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        weight = copy_to_tensor_model_parallel_region(self.weight) if self.shared_over_tp else self.weight
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden = weight * hidden.to(dtype)
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
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from megarl.platform import device as platform_device

        tp = config.tensor_model_parallel_size
        if config.context_parallel_size > 1:
            raise ValueError("megarl's gated DeltaNet layer (Qwen3-Next's linear attention) runs at context parallel "
                             f"size 1, got cp={config.context_parallel_size}; use tensor, pipeline or expert parallelism")
        if value_heads % key_heads:
            raise ValueError(f"linear_num_value_heads={value_heads} must be a multiple of linear_num_key_heads={key_heads}")
        if key_heads % tp:
            raise ValueError(f"linear_num_key_heads={key_heads} must divide by the tensor parallel size {tp}: "
                             "a TP rank holds whole key heads")
        self.layer_number, self.sequence_parallel = layer_number, bool(config.sequence_parallel)
        # this rank's heads
        self.key_heads, self.value_heads = key_heads // tp, value_heads // tp
        self.dk, self.dv, self.ratio = key_head_dim, value_head_dim, value_heads // key_heads
        where, dtype = "cpu" if config.use_cpu_initialization else platform_device(), config.params_dtype
        hidden = config.hidden_size
        key_dim, value_dim = self.key_heads * key_head_dim, self.value_heads * value_head_dim
        self.group_rows = 2 * key_head_dim + self.ratio * value_head_dim  # q_g, k_g, v_g of one key head
        self.conv_dim = 2 * key_dim + value_dim

        def split(param: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
            set_tensor_model_parallel_attributes(param, True, dim, 1)
            return param

        def linear(rows: int, cols: int, dim: int = 0) -> torch.nn.Linear:
            layer = torch.nn.Linear(cols, rows, bias=False, device=where, dtype=dtype)
            if config.perform_initialization:
                config.init_method(layer.weight)
            split(layer.weight, dim)
            return layer

        self.fused_projections = fused_projections
        if fused_projections:  # Qwen3-Next
            self.in_proj_qkvz = linear(2 * key_dim + 2 * value_dim, hidden)
            self.in_proj_ba = linear(2 * self.value_heads, hidden)
        else:  # Qwen3.5
            self.in_proj_qkv_grouped = linear(self.conv_dim, hidden)
            self.in_proj_z = linear(value_dim, hidden)
            self.in_proj_b = linear(self.value_heads, hidden)
            self.in_proj_a = linear(self.value_heads, hidden)
        self.conv1d_grouped = torch.nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                              bias=False, padding=conv_kernel - 1, device=where, dtype=dtype)
        split(self.conv1d_grouped.weight, 0)
        self.dt_bias = split(torch.nn.Parameter(torch.ones(self.value_heads, device=where, dtype=dtype)), 0)
        self.A_log = split(torch.nn.Parameter(
            torch.log(torch.empty(self.value_heads, device=where, dtype=dtype).uniform_(1, 16))), 0)
        self.norm = GatedRMSNorm(value_head_dim, config.layernorm_epsilon, dtype, where, shared_over_tp=tp > 1)
        self.out_proj = linear(hidden, value_dim, dim=1)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        """[s, b, hidden] (or packed [t, 1, hidden]; [s / tp, b, hidden] under sequence parallelism) -> the same
        shape, and None."""
        from megatron.core import tensor_parallel as tpl

        if attention_mask is not None:
            raise ValueError("the gated DeltaNet layer takes no attention mask (causal by construction)")
        if self.sequence_parallel:  # every rank's heads need the whole sequence
            x = tpl.gather_from_sequence_parallel_region(hidden_states).transpose(0, 1)  # [b, s, h]
        else:  # the input's gradient is the sum of every rank's heads': megatron all-reduces it in place, and
            # only a contiguous gradient is reduced (a transposed one would be copied, reduced and dropped)
            x = tpl.copy_to_tensor_model_parallel_region(hidden_states.transpose(0, 1).contiguous())
        if packed_seq_params is None:
            out = self._mix(x)
        else:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = (cu if cu is not None else packed_seq_params.cu_seqlens_q).tolist()
            if x.shape[0] != 1 or cu[-1] != x.shape[1]:
                raise ValueError(f"packed sequences: one row of {cu[-1]} tokens expected, got {tuple(x.shape[:2])}")
            out = torch.cat([self._mix(x[:, start:stop]) for start, stop in zip(cu[:-1], cu[1:]) if stop > start], 1)
        out = out.transpose(0, 1).contiguous()  # this rank's heads' share of out_proj
        if self.sequence_parallel:
            return tpl.reduce_scatter_to_sequence_parallel_region(out), None
        return tpl.reduce_from_tensor_model_parallel_region(out), None

    def _split(self, x: torch.Tensor):
        """qkv [b, s, key heads, group rows] (q_g, k_g, v_g per key head); z [b, s, value heads, dv]; b, a
        [b, s, value heads]."""
        batch, seq = x.shape[:2]
        heads = (batch, seq, self.value_heads)
        if not self.fused_projections:
            qkv = self.in_proj_qkv_grouped(x).view(batch, seq, self.key_heads, self.group_rows)
            return qkv, self.in_proj_z(x).view(*heads, self.dv), self.in_proj_b(x), self.in_proj_a(x)
        r, dv = self.ratio, self.dv
        qkvz = self.in_proj_qkvz(x).view(batch, seq, self.key_heads, self.group_rows + r * dv)
        qkv, z = torch.split(qkvz, [self.group_rows, r * dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(batch, seq, self.key_heads, 2 * r), [r, r], dim=-1)
        return qkv, z.reshape(*heads, dv), b.reshape(heads), a.reshape(heads)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

        batch, seq = x.shape[:2]
        qkv, z, b, a = self._split(x)
        mixed = qkv.reshape(batch, seq, self.conv_dim).transpose(1, 2)
        mixed = F.silu(self.conv1d_grouped(mixed)[..., :seq]).transpose(1, 2)
        mixed = mixed.reshape(batch, seq, self.key_heads, self.group_rows)
        q, k, v = torch.split(mixed, [self.dk, self.dk, self.ratio * self.dv], dim=-1)
        q, k = l2norm(q), l2norm(k)
        v = v.reshape(batch, seq, self.value_heads, self.dv)
        if self.ratio > 1:
            q, k = q.repeat_interleave(self.ratio, dim=2), k.repeat_interleave(self.ratio, dim=2)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out, _ = torch_chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g=g, beta=beta,
                                              use_qk_l2norm_in_kernel=False)
        out = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(out.reshape(batch, seq, -1))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Distributed-checkpoint shards: the head-split parameters along their TP dim (the same global tensors at
        any TP), the norm's weight replicated."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axes = {name: param.partition_dim for name, param in self.named_parameters()
                if getattr(param, "tensor_model_parallel", False)}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])
