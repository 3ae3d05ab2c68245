"""Activation memory of one training micro-batch: what autograd keeps for the backward pass.

Counted per decoder layer from what each op of megarl's layer saves (checked against a real
engine with saved-tensor hooks, ``tests/plan/test_plan_vs_engine.py``), for ``T = b * s``
tokens of one rank (``/ cp`` with context parallelism, ``/ tp`` where sequence parallelism shards
them), activation itemsize ``e``:

* each norm keeps its input and its normalised output (and an fp32 ``rstd``); the linear after it
  keeps its input (megatron keeps the sequence-parallel shard and gathers it again in backward);
* attention with a fused kernel keeps q, k, v, the output and the softmax statistics. Transformer
  Engine keeps this rank's k/v, context parallelism included. megarl's local core attention
  (``megarl.models.attention``) runs torch's SDPA on k/v expanded to all query heads (one sample
  at a time when packed, which keeps one more copy of the output: measured), and under context
  parallelism its blockwise kernel on the CP group's gathered k/v (the whole sequence, not expanded);
* a SwiGLU MLP keeps fc1's output, the activation's intermediates and fc2's input (five ``T * f``
  on the local spec, three with Transformer Engine's fused activation); a MoE layer does so for
  ``topk`` copies of every token (routing assumed balanced) plus the router's and the permuted
  tokens, and a shared expert like a dense MLP;
* the output layer: the fp32 log-softmax of the response positions this rank scores (megarl picks
  them from the logits by index, which keeps only the index).

Recompute (megatron's ``recompute_granularity``/``method``/``num_layers``/``modules``) keeps only
the checkpointed inputs and holds one recomputed group at a time. The pipeline schedule holds
several micro-batches on the early stages (1F1B: ``pp - stage``; interleaved: megatron's warm-up
count of chunk micro-batches).
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.models.dims import MLAttention, ModelDims

FP32 = 4
KERNELS = ("local", "transformer_engine")
SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj")


@dataclass(frozen=True)
class Recompute:
    """megatron-core's activation recompute settings (``TransformerConfig`` fields)."""

    granularity: str | None = None  # None | full | selective
    method: str | None = None  # uniform | block (full)
    num_layers: int | None = None
    modules: tuple[str, ...] = ("core_attn",)  # selective

    @classmethod
    def from_overrides(cls, overrides: dict) -> "Recompute":
        granularity = overrides.get("recompute_granularity")
        modules = tuple(overrides.get("recompute_modules") or ("core_attn",))
        unknown = sorted(set(modules) - set(SELECTIVE_MODULES)) if granularity == "selective" else []
        if unknown:
            raise ValueError(f"recompute_modules {unknown}: the planner knows {list(SELECTIVE_MODULES)}")
        return cls(granularity, overrides.get("recompute_method"), overrides.get("recompute_num_layers"), modules)

    def describe(self) -> str:
        if self.granularity == "full":
            return f"full recompute, {self.method}, {self.num_layers} layer(s) per unit"
        if self.granularity == "selective":
            return f"selective recompute of {', '.join(self.modules)}"
        return "no recompute"


@dataclass(frozen=True)
class MicroBatch:
    """The shape of one micro-batch: ``rows`` samples of ``seq`` tokens, ``response`` scored per row."""

    rows: int
    seq: int
    response: int

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


@dataclass(frozen=True)
class Shape:
    """The per-rank sizes activation counts need."""

    dims: ModelDims
    tp: int = 1
    etp: int = 1  # expert tensor parallel: splits each expert's FFN
    sequence_parallel: bool = False
    cp: int = 1
    itemsize: int = 2
    kernel: str = "transformer_engine"
    packed: bool = True  # packed micro-batches (use_remove_padding; the local kernel then runs SDPA per sample)

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel {self.kernel!r}; expected one of {KERNELS}")


@dataclass
class LayerBytes:
    """Saved bytes of one decoder layer, by part (a ``selective`` recompute drops some parts)."""

    norms: int = 0  # both norms: inputs, normalised outputs, fp32 rstd
    norm_inputs: int = 0  # what checkpointed norms still keep (recompute module "layernorm")
    linear_inputs: int = 0  # the inputs kept by the linears after the norms
    core_attention: int = 0
    core_attention_inputs: int = 0  # q, k, v as the core attention receives them ("core_attn")
    attention_other: int = 0  # RoPE tables, q/k norms, MLA's latent projections, linear_proj's input
    mlp: int = 0  # the dense MLP's or the routed experts' internals ("mlp", "moe")
    mlp_act: int = 0  # the activation's part of ``mlp`` ("moe_act")
    shared_experts: int = 0
    router: int = 0
    moe: bool = False

    @property
    def total(self) -> int:
        return (self.norms + self.linear_inputs + self.core_attention + self.attention_other
                + self.mlp + self.shared_experts + self.router)


def _attention(out: LayerBytes, shape: Shape, mb: MicroBatch, tokens: int) -> None:
    att, e, tp, local, cp = shape.dims.attention, shape.itemsize, shape.tp, shape.kernel == "local", shape.cp
    stats = tokens * (att.num_heads // tp) * FP32  # one log-sum-exp per query and head
    if isinstance(att, MLAttention):
        heads = att.num_heads // tp
        q_rank = att.q_lora_rank or 0
        latent = att.kv_lora_rank + att.qk_rope_head_dim
        q = tokens * heads * att.qk_head_dim * e
        v = tokens * heads * att.v_head_dim * e
        # q/kv down-projection outputs through their norms (input, normalised, output), RoPE
        # tables, and linear_proj's input (the attention output)
        out.attention_other = (tokens * (3 * q_rank + latent + 2 * att.kv_lora_rank) * e
                               + 4 * mb.seq * att.qk_rope_head_dim * FP32 + v)
        out.core_attention_inputs = 2 * q + v
        kv = (q + v) * (cp if local else 1)  # the local kernel gathers the CP group's k/v
        copy = v if local and shape.packed and cp == 1 else 0  # packed SDPA's output, assembled per sample
        out.core_attention = q + kv + (v if local else 0) + copy + stats
        return
    heads, groups = att.num_heads // tp, max(1, att.num_query_groups // tp)
    q = tokens * heads * att.head_dim * e
    kv = 2 * tokens * groups * att.head_dim * e
    if local and cp > 1:  # the blockwise kernel on the gathered, unexpanded k/v
        attended = cp * kv
    else:  # SDPA on k/v repeated per query head (local), or Transformer Engine on this rank's k/v
        attended = 2 * tokens * heads * att.head_dim * e if local else kv
    qkv_out = tokens * (heads + 2 * groups) * att.head_dim * e
    copy = q if local and shape.packed and cp == 1 else 0  # packed SDPA's output, assembled per sample
    out.core_attention = q + attended + q + copy + stats  # q, k, v, output, logsumexp
    # checkpointed (selective core_attn): q and k after RoPE, v (a view of the qkv output), and the
    # output, which linear_proj now keeps on its own
    out.core_attention_inputs = q + kv // 2 + q + (0 if att.qk_norm else qkv_out)
    out.attention_other = 4 * mb.seq * att.head_dim * FP32  # RoPE cos/sin of q and k
    if att.qk_norm:  # the qkv output, a copy of q, both normalised, their rstd
        out.attention_other += qkv_out + 2 * q + kv // 2 + tokens * (heads + groups) * FP32


def layer_bytes(shape: Shape, mb: MicroBatch, moe_layer: bool) -> LayerBytes:
    """What one decoder layer of this rank saves for backward (no recompute)."""
    d, e, tp = shape.dims, shape.itemsize, shape.tp
    tokens = mb.tokens // shape.cp
    sp_tokens = tokens // tp if shape.sequence_parallel else tokens
    h, local = d.hidden_size, shape.kernel == "local"
    out = LayerBytes(moe=moe_layer)
    out.norms = 2 * (2 * sp_tokens * h * e + sp_tokens * FP32)
    out.norm_inputs = 2 * sp_tokens * h * e
    out.linear_inputs = 2 * sp_tokens * h * e  # the qkv (or q/kv down) and fc1 (or router) inputs
    _attention(out, shape, mb, tokens)
    # beyond fc1's output (2 f): the local spec keeps two activation intermediates and fc2's input,
    # Transformer Engine's fused SwiGLU only fc2's input; experts also multiply by their routing
    # probability (one more f)
    beyond = 3 if local else 1
    if moe_layer:
        moe = d.moe
        routed = tokens * moe.topk
        f = moe.ffn_hidden_size // shape.etp
        out.mlp_act = routed * (beyond + 1) * f * e
        out.mlp = routed * h * e + routed * 2 * f * e + out.mlp_act  # permuted tokens, fc1's output, the rest
        out.router = tokens * moe.num_experts * (2 * FP32 + 2) + routed * 24  # scores, masks, indices
        if moe.shared_expert_ffn_hidden_size:
            out.shared_experts = tokens * (2 + beyond) * (moe.shared_expert_ffn_hidden_size // tp) * e
    else:
        f = d.ffn_hidden_size // tp
        out.mlp_act = tokens * beyond * f * e
        out.mlp = tokens * 2 * f * e + out.mlp_act
    return out


def layer_with_selective(layer: LayerBytes, modules: tuple[str, ...]) -> int:
    """Saved bytes of a layer under selective recompute of ``modules`` (megatron: ``mlp`` applies to
    dense layers, ``moe`` checkpoints a whole MoE block; ``mla_up_proj``: no saving counted)."""
    total = layer.total
    if "core_attn" in modules:
        total += layer.core_attention_inputs - layer.core_attention
    if "layernorm" in modules:
        total += layer.norm_inputs - layer.norms
    if not layer.moe and "mlp" in modules:
        total -= layer.mlp
    if layer.moe and "moe" in modules:
        total -= layer.mlp + layer.router + layer.shared_experts
    else:
        if layer.moe and "moe_act" in modules:
            total -= layer.mlp_act
        if "shared_experts" in modules:
            total -= layer.shared_experts
    return total


@dataclass(frozen=True)
class ChunkBytes:
    """One chunk's activations for one micro-batch: what the forward pass leaves saved, what of it
    is still there while a recomputed group is live in the backward pass, and that group."""

    saved: int
    saved_during_recompute: int = 0
    recomputed: int = 0


def chunk_bytes(shape: Shape, mb: MicroBatch, moe_layers: list[bool], recompute: Recompute) -> ChunkBytes:
    """The activations of one model chunk (its layers in order) for one micro-batch."""
    if not moe_layers:
        return ChunkBytes(0)
    layers = [layer_bytes(shape, mb, moe) for moe in moe_layers]
    tokens = mb.tokens // shape.cp
    checkpoint_input = (tokens // shape.tp if shape.sequence_parallel else tokens) * shape.dims.hidden_size * shape.itemsize
    if recompute.granularity == "full":
        n = max(1, recompute.num_layers or 1)
        if recompute.method == "block":  # the first n layers keep their inputs only, one recomputed at a time
            n = min(n, len(layers))
            inputs = n * checkpoint_input
            return ChunkBytes(inputs + sum(layer.total for layer in layers[n:]), inputs,
                              max(layer.total for layer in layers[:n]))
        groups = [layers[i:i + n] for i in range(0, len(layers), n)]  # uniform: groups of n, inputs only
        inputs = len(groups) * checkpoint_input
        return ChunkBytes(inputs, inputs, max(sum(layer.total for layer in g) for g in groups))
    if recompute.granularity == "selective":  # one layer's recomputed modules are live during its backward
        kept = [layer_with_selective(layer, recompute.modules) for layer in layers]
        saved = sum(kept)
        return ChunkBytes(saved, saved, max(layer.total - k for layer, k in zip(layers, kept)))
    return ChunkBytes(sum(layer.total for layer in layers))


def rank_peak(chunk: ChunkBytes, in_flight_units: int, head: int) -> int:
    """Peak saved bytes of a rank holding ``in_flight_units`` chunk micro-batches (and, on the last
    stage, the head's ``head`` bytes): the forward peak, or the backward one with a recomputed
    group live (the head's tensors are freed before the layers' backward starts)."""
    forward = in_flight_units * chunk.saved + head
    backward = (in_flight_units - 1) * chunk.saved + chunk.saved_during_recompute + chunk.recomputed
    return max(forward, backward)


def head_bytes(shape: Shape, mb: MicroBatch, padded_vocab: int, critic: bool, entropy_grad: bool) -> int:
    """The last stage's final norm, output layer and log-softmax (saved for backward)."""
    d, e, tp = shape.dims, shape.itemsize, shape.tp
    tokens = mb.tokens // shape.cp
    sp_tokens = tokens // tp if shape.sequence_parallel else tokens
    norm = 2 * sp_tokens * d.hidden_size * e + sp_tokens * FP32 + sp_tokens * d.hidden_size * e
    if critic:
        return norm + tokens * FP32
    vocab = padded_vocab // tp
    response = mb.rows * mb.response // shape.cp  # a CP rank scores the response tokens it holds
    logits = response * vocab * FP32  # the fp32 log-softmax of the picked positions (picking keeps an index)
    if entropy_grad:  # the entropy bonus (entropy_coeff != 0) keeps its own fp32 intermediates
        logits += 3 * response * vocab * FP32
    return norm + logits


def head_workspace(shape: Shape, mb: MicroBatch, padded_vocab: int, critic: bool) -> int:
    """Transient bytes around the loss and its backward, on top of what is saved: the entropy
    metric's fp32 intermediates and the logits' gradient (response positions, then all)."""
    if critic:
        return 0
    vocab = padded_vocab // shape.tp
    response = mb.rows * mb.response // shape.cp * vocab
    return max(3 * response * FP32, response * shape.itemsize + mb.tokens // shape.cp * vocab * shape.itemsize)


def in_flight(pp: int, vpp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches (of one chunk) whose activations a stage holds at its peak."""
    if pp == 1:
        return 1
    if vpp == 1:
        return max(1, min(pp - stage, micro_batches))
    warmup = (pp - stage - 1) * 2 + (vpp - 1) * pp
    return max(1, min(warmup + 1, micro_batches * vpp))


def forward_workspace(shape: Shape, mb: MicroBatch, padded_vocab: int, logits: bool, entropy: bool) -> int:
    """Peak transient bytes of a forward-only pass (log-probs, values): the largest layer
    intermediates and, with ``logits`` (an LM's last stage), the logits and their fp32 log-softmax
    (and the entropy's fp32 intermediates)."""
    d, e, tp = shape.dims, shape.itemsize, shape.tp
    tokens = mb.tokens // shape.cp
    if d.moe is not None:
        f = max(d.ffn_hidden_size // tp, d.moe.topk * d.moe.ffn_hidden_size)
    else:
        f = d.ffn_hidden_size // tp
    layer = tokens * (2 * d.hidden_size + 3 * f) * e
    if not logits:
        return layer
    vocab = padded_vocab // tp
    response = mb.rows * mb.response // shape.cp * vocab
    return layer + tokens * vocab * e + response * FP32 * (4 if entropy else 1)
