"""megarl's core attention for megatron-core's local layer spec: exact causal attention over padded
rows or packed sequences, with context parallelism, sliding windows, logit soft-capping and sinks.

megatron-core 0.16.1's local ``DotProductAttention`` materialises ``[b, heads, s, s]`` scores, takes
no packed sequences (``PackedSeqParams``) and refuses context parallelism; those need Transformer
Engine, which has no CPU build. ``CoreAttention`` takes its place in the local spec
(``use_core_attention``) with megatron's constructor and call signature, so the attention module
around it (RoPE over ``cu_seqlens``, the projections, MLA) is megatron's own. What it computes:

* padded rows ``[s, b, heads, d]``: causal attention per row;
* packed sequences (``packed_seq_params.qkv_format == "thd"``, ``[t, heads, d]``): causal attention
  within each sequence of ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``), nothing across them;
* context parallelism (the CP group of ``pg_collection``, packed sequences only): this rank's
  queries (its two chunks of every sequence, ``context_parallel``) over the whole sequence's keys
  and values, all-gathered from the CP group with the matching reduce-scatter in backward;
* a sliding window per layer: megatron's ``window_size=(left, 0)`` with ``window_attn_skip_freq``,
  or ``window=W`` given to the module (Hugging Face's ``sliding_window``: the W keys ending at the
  query), the latter winning;
* logit soft-capping ``softcap=c`` (Gemma-2): ``c * tanh(scores / c)`` before the mask;
* attention sinks: megatron's ``softmax_type`` ``learnable`` (a per-head logit ``softmax_offset``
  that joins the softmax denominator, gpt-oss) or ``off-by-one`` (a zero logit).

Plain causal attention without CP runs on torch's fused SDPA (per sequence when packed), as fast as
before; everything else runs on the exact blockwise kernel (``kernels``). ``window`` and ``softcap``
are per-module arguments: a layer spec passes them with
``ModuleSpec(module=CoreAttention, params={"window": ..., "softcap": ...})``.
"""
from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule

from megarl.models.attention.context_parallel import gather_packed_row, lengths_from_cu_seqlens, packed_layout
from megarl.models.attention.kernels import blockwise_attention, sdpa_causal, sdpa_causal_segments


class CoreAttention(MegatronModule):
    """megatron-core's core-attention interface (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None, k_channels: int | None = None, v_channels: int | None = None,
                 window: int | None = None, softcap: float | None = None):
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import divide

        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling (fp16 score scaling) is not supported by megarl's core "
                             "attention; megarl trains in bf16 or fp32")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection, self.tp_group = pg_collection, pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        self.cp_rank = self.cp_group.rank() if self.cp_group is not None else 0
        self.layer_number = max(1, layer_number)
        tp = pg_collection.tp.size()
        projection = config.kv_channels * config.num_attention_heads  # the output width (MLA: v_head_dim)
        self.hidden_size_per_partition = divide(projection, tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(
            divide(projection, config.num_attention_heads))
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = window if window is not None else _config_window(config, layer_number)
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must hold at least one token, got window={self.window}")
        self.softcap = softcap
        self._init_sinks(config)

    def _init_sinks(self, config) -> None:
        heads = self.num_attention_heads_per_partition
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type == "vanilla":
            self.softmax_offset = None
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype), persistent=False)
        elif softmax_type == "learnable":
            from megarl.platform import device as platform_device

            device = "cpu" if config.use_cpu_initialization else platform_device()
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
            # one logit per head: split over TP with the heads (a per-rank slice, not a TP duplicate)
            self.softmax_offset.tensor_model_parallel = True
            self.softmax_offset.partition_dim = 0
            self.softmax_offset.partition_stride = 1
        else:
            raise ValueError(f"softmax_type={softmax_type!r}: megarl's core attention knows vanilla, off-by-one, learnable")

    @property
    def plain(self) -> bool:
        """Causal softmax attention with nothing added: torch's fused SDPA computes it exactly."""
        return self.window is None and self.softcap is None and self.softmax_offset is None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("megarl's core attention takes no attention bias")
        packed = packed_seq_params is not None
        if packed and packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in {packed_seq_params.qkv_format!r} format; megarl packs them as 'thd'")
        if self.cp_size > 1 and not packed:
            raise ValueError("context parallelism runs on packed sequences (PackedSeqParams, 'thd'); the engine "
                             "packs micro-batches when <role>.megatron.use_remove_padding is on")
        if not self.plain and self.training and self.dropout:
            raise ValueError("attention dropout is only supported for plain causal attention without context "
                             "parallelism (no sliding window, soft-capping or sinks)")
        if packed:
            if attention_mask is not None:
                raise ValueError("packed sequences take no attention mask: cu_seqlens separate them")
            return self._packed(query, key, value, packed_seq_params)
        return self._padded(query, key, value, attention_mask)

    def _dropout(self) -> float:
        return self.dropout if self.training else 0.0

    def _sdpa(self, fn, *args):
        """``fn`` with megatron's RNG handling of attention dropout (the TP tracker's fork without SP)."""
        from megatron.core import tensor_parallel

        if self._dropout() and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return fn(*args)
        return fn(*args)

    def _padded(self, query, key, value, attention_mask):
        seq, batch = query.shape[0], query.shape[1]
        if attention_mask is not None:
            if not self.plain:
                raise ValueError("an explicit attention mask cannot combine with a sliding window, soft-capping or sinks")
            out = self._sdpa(_masked_sdpa, query, key, value, attention_mask, self.softmax_scale, self._dropout())
        elif self.plain:
            out = self._sdpa(sdpa_causal, query, key, value, self.softmax_scale, self._dropout())
        else:  # each row is one sequence of the blockwise kernel
            rows = [t.permute(1, 0, 2, 3).reshape(batch * seq, t.shape[2], t.shape[3]) for t in (query, key, value)]
            positions = torch.arange(seq, device=query.device).repeat(batch)
            segments = [(i * seq, (i + 1) * seq, i * seq, (i + 1) * seq) for i in range(batch)]
            flat = self._blockwise(*rows, positions, positions, segments)
            out = flat.reshape(batch, seq, flat.shape[1], flat.shape[2]).permute(1, 0, 2, 3)
        return out.reshape(seq, batch, self.hidden_size_per_partition)

    def _packed(self, query, key, value, params):
        cu_seqlens = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        layout = packed_layout(lengths_from_cu_seqlens(cu_seqlens), self.cp_size, self.cp_rank)
        if query.shape[0] != layout.local_offsets[-1]:
            raise ValueError(f"{query.shape[0]} packed tokens on this rank, but cu_seqlens describe "
                             f"{layout.local_offsets[-1]} (of {layout.offsets[-1]} over CP={self.cp_size})")
        if self.plain and self.cp_size == 1:
            out = self._sdpa(sdpa_causal_segments, query, key, value, layout.offsets, self.softmax_scale,
                             self._dropout())
        else:
            key = gather_packed_row(key, layout, self.cp_group)
            value = gather_packed_row(value, layout, self.cp_group)
            out = self._blockwise(query, key, value, layout.local_positions.to(query.device),
                                  layout.sequence_positions.to(query.device), layout.segments)
        return out.reshape(out.shape[0], self.hidden_size_per_partition)

    def _blockwise(self, query, key, value, query_positions, key_positions, segments):
        return blockwise_attention(query, key, value, query_positions, key_positions, segments, self.softmax_scale,
                                   self.window, self.softcap, self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sinks as a TP-sharded tensor (as megatron's ``DotProductAttention``); else nothing."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        learnable = isinstance(self.softmax_offset, torch.nn.Parameter)
        state = self.state_dict(prefix="", keep_vars=True) if learnable else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def _masked_sdpa(query, key, value, attention_mask, scale: float, dropout: float):
    """Attention under megatron's explicit boolean mask (True = hidden), as the local spec applies it."""
    import torch.nn.functional as F

    groups = query.shape[2] // key.shape[2]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(), dropout_p=dropout, scale=scale)
    return out.permute(2, 0, 1, 3)


def _config_window(config, layer_number: int) -> int | None:
    """megatron's per-layer ``window_size=(left, right)`` as a Hugging Face window (``left + 1`` keys)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right != 0:
        raise ValueError(f"window_size={tuple(config.window_size)}: causal attention sees no future keys; use (left, 0)")
    return None if left < 0 else left + 1


def use_core_attention(layer_spec) -> bool:
    """Put ``CoreAttention`` in place of megatron's local ``DotProductAttention`` in one layer spec
    (Transformer Engine's attention is left alone). Returns whether it did."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    submodules = getattr(attention, "submodules", None)
    current = getattr(submodules, "core_attention", None)
    module = current.module if isinstance(current, ModuleSpec) else current
    if not (isinstance(module, type) and issubclass(module, (DotProductAttention, CoreAttention))):
        return False
    submodules.core_attention = CoreAttention if not isinstance(current, ModuleSpec) else \
        ModuleSpec(module=CoreAttention, params=current.params)
    return True
