"""DeepSeek-V3 (DeepseekV3ForCausalLM; Kimi-K2 has the same architecture): MLA and DeepSeekMoE.

Attention (multi-latent, megatron-core ``MLATransformerConfig``, local spec names):

=====================================  ==========================================  ============
megatron (``self_attention.``)         HF (``self_attn.``)                         TP split
=====================================  ==========================================  ============
``linear_q_down_proj``                 ``q_a_proj`` [q_lora_rank, hidden]          rows (TE: replicated)
``q_layernorm``                        ``q_a_layernorm``                           replicated
``linear_q_up_proj``                   ``q_b_proj`` [heads * (nope + rope), q_lora]  rows = whole heads
``linear_q_proj`` (no q latent)        ``q_proj``                                  rows = whole heads
``linear_kv_down_proj``                ``kv_a_proj_with_mqa`` [kv_lora + rope, hidden]  rows (TE: replicated)
``kv_layernorm``                       ``kv_a_layernorm`` [kv_lora_rank]           replicated
``linear_kv_up_proj``                  ``kv_b_proj`` [heads * (nope + v), kv_lora]  rows = whole heads
``linear_proj``                        ``o_proj``                                  columns
=====================================  ==========================================  ============

No row permutation is needed anywhere. RoPE is YaRN (or default) with interleaved rotary pairs
(``rope_interleave=True``, megatron's MLA layout); the softmax scale carries YaRN's mscale.

MoE: sigmoid scores plus the fp32 ``e_score_correction_bias`` for the choice only (megatron's
``mlp.router.expert_bias``, a buffer megatron updates every step by
``moe_router_bias_update_rate``; the weight sync carries it with the weights), group-limited
top-k (``n_group`` groups, the ``topk_group`` best by the sum of their top-2 scores), weights
renormalised then multiplied by ``routed_scaling_factor``; a shared expert next to the routed
ones; the first ``first_k_dense_replace`` layers dense.

Refused, naming the field: routing megatron cannot reproduce exactly (``norm_topk_prob=False``,
``num_experts_per_tok / topk_group != 2``, ``scoring_func`` or ``topk_method`` other than
DeepSeek-V3's), ``rope_interleave=False``, YaRN ``truncate=False``, ``attention_bias=True``.

The multi-token-prediction layers of a checkpoint (``model.layers.<num_hidden_layers + k>.*``,
``num_nextn_predict_layers`` of them) are skipped, named in one log line when a checkpoint holds
them: megarl trains and serves the main model (as transformers and vLLM do without speculative
decoding).

vLLM stacks ``q_a_proj`` and ``kv_a_proj_with_mqa`` into one replicated ``fused_qkv_a_proj`` and
derives ``W_UK_T``/``W_UV`` from ``kv_b_proj`` after every load; it needs ``topk_method`` and
``scoring_func`` in the config (transformers does not write them), given as ``vllm_hf_overrides``.
"""
from __future__ import annotations

import re
from dataclasses import replace

from megarl.models.dims import MLAttention, ModelDims, MoE, YarnRope, common_dims, read_rope
from megarl.models.families.base import FamilySpec, ParamMap, fused_pre_mlp_norm, layer_norm_params, moe_params, swiglu_params
from megarl.models.mappings import HFTensor, Replicated, Split

# What vLLM's DeepSeek model reads from config.json to route like DeepSeek-V3 (it defaults to softmax).
VLLM_HF_OVERRIDES = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _refuse(config, field: str, value, why: str) -> ValueError:
    return ValueError(f"{config.model_type}: {field}={value!r} is not supported by the megatron bridge: {why}")


def _check_routing(config) -> None:
    for field, expected in VLLM_HF_OVERRIDES.items():
        value = getattr(config, field, expected)
        if value != expected:
            raise _refuse(config, field, value, f"DeepSeek-V3 routes with {field}={expected!r} (DeepSeek-V2's "
                          "softmax/greedy routing is another architecture)")
    if not config.norm_topk_prob:
        raise _refuse(config, "norm_topk_prob", False, "megatron-core always renormalises sigmoid top-k scores")
    if config.n_routed_experts % config.n_group:
        raise _refuse(config, "n_group", config.n_group, f"n_routed_experts={config.n_routed_experts} must split into "
                      "equal groups")
    if config.topk_group < config.n_group and config.num_experts_per_tok != 2 * config.topk_group:
        raise _refuse(config, "num_experts_per_tok / topk_group", f"{config.num_experts_per_tok}/{config.topk_group}",
                      "megatron-core scores a group by its top (num_experts_per_tok / topk_group) experts, "
                      "DeepSeek-V3 by its top 2: the ratio must be 2 (DeepSeek-V3: 8 / 4) whenever groups are "
                      "dropped (topk_group < n_group)")


def read_dims(config) -> ModelDims:
    if getattr(config, "attention_bias", False):
        raise _refuse(config, "attention_bias", True, "DeepSeek-V3 has no attention biases")
    if getattr(config, "rope_interleave", True) is not True:
        raise _refuse(config, "rope_interleave", config.rope_interleave, "megatron-core's MLA applies RoPE to "
                      "interleaved pairs (DeepSeek's checkpoints); a de-interleaved checkpoint needs permuted rows")
    _check_routing(config)
    rope = read_rope(config, supported=("default", "yarn"))
    attention = MLAttention(
        num_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
    )
    dense = config.first_k_dense_replace
    moe = MoE(
        num_experts=config.n_routed_experts,
        ffn_hidden_size=config.moe_intermediate_size,
        topk=config.num_experts_per_tok,
        layers=tuple(i >= dense for i in range(config.num_hidden_layers)),
        norm_topk_prob=True,
        score_function="sigmoid",
        # every group kept (e.g. Moonlight: n_group = topk_group = 1): no group limit to apply
        num_groups=config.n_group if config.topk_group < config.n_group else None,
        group_topk=config.topk_group if config.topk_group < config.n_group else None,
        scaling_factor=float(config.routed_scaling_factor),
        expert_bias=True,
        shared_expert_ffn_hidden_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
    )
    return common_dims(config, attention=attention, rope=rope, moe=moe)


def mla_params(dims: ModelDims, i: int) -> list[ParamMap]:
    p = f"model.layers.{i}.self_attn."
    a: MLAttention = dims.attention
    hidden, heads = dims.hidden_size, a.num_heads
    kv_down = a.kv_lora_rank + a.qk_rope_head_dim
    params = []
    if a.q_lora_rank is None:
        params.append(ParamMap("self_attention.linear_q_proj.weight", Split(HFTensor(p + "q_proj.weight", (heads * a.qk_head_dim, hidden)), 0)))
    else:
        params += [
            ParamMap("self_attention.linear_q_down_proj.weight", Split(HFTensor(p + "q_a_proj.weight", (a.q_lora_rank, hidden)), 0)),
            ParamMap("self_attention.q_layernorm.weight", Replicated(HFTensor(p + "q_a_layernorm.weight", (a.q_lora_rank,)))),
            ParamMap("self_attention.linear_q_up_proj.weight",
                     Split(HFTensor(p + "q_b_proj.weight", (heads * a.qk_head_dim, a.q_lora_rank)), 0)),
        ]
    params += [
        ParamMap("self_attention.linear_kv_down_proj.weight", Split(HFTensor(p + "kv_a_proj_with_mqa.weight", (kv_down, hidden)), 0)),
        ParamMap("self_attention.kv_layernorm.weight", Replicated(HFTensor(p + "kv_a_layernorm.weight", (a.kv_lora_rank,)))),
        ParamMap("self_attention.linear_kv_up_proj.weight",
                 Split(HFTensor(p + "kv_b_proj.weight", (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)), 0)),
        ParamMap("self_attention.linear_proj.weight", Split(HFTensor(p + "o_proj.weight", (hidden, heads * a.v_head_dim)), 1)),
    ]
    return params


def deepseek_moe_params(dims: ModelDims, i: int) -> list[ParamMap]:
    p = f"model.layers.{i}.mlp."
    params = moe_params(dims, p + "gate.weight", p + "experts.{e}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
    bias = HFTensor(p + "gate.e_score_correction_bias", (dims.moe.num_experts,))
    params.insert(1, ParamMap("mlp.router.expert_bias", Replicated(bias), buffer=True))
    if dims.moe.shared_expert_ffn_hidden_size:
        s = p + "shared_experts."
        params += swiglu_params("mlp.shared_experts.", s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight",
                                dims.hidden_size, dims.moe.shared_expert_ffn_hidden_size)
    return params


def deepseek_mlp_params(dims: ModelDims, i: int) -> list[ParamMap]:
    """Layer ``i``'s MLP: DeepSeekMoE on MoE layers, a dense SwiGLU on the first ``first_k_dense_replace``."""
    if dims.is_moe_layer(i):
        return deepseek_moe_params(dims, i)
    p = f"model.layers.{i}.mlp."
    return swiglu_params("mlp.", p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight",
                         dims.hidden_size, dims.ffn_hidden_size)


def layer_params(dims: ModelDims, i: int) -> list[ParamMap]:
    return layer_norm_params(dims, i) + mla_params(dims, i) + deepseek_mlp_params(dims, i)


def transformer_config(dims: ModelDims) -> dict:
    """MLATransformerConfig fields: MLA shapes, RoPE, DeepSeekMoE routing and the shared expert."""
    a: MLAttention = dims.attention
    moe: MoE = dims.moe
    rope = dims.rope
    fields = dict(
        multi_latent_attention=True,
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_head_dim=a.qk_nope_head_dim,  # megatron's qk_head_dim is HF's qk_nope_head_dim
        qk_pos_emb_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        kv_channels=a.v_head_dim,  # the core attention's output width per head
        qk_layernorm=True,  # the latent norms q_a_layernorm / kv_a_layernorm exist only then
        rotary_base=rope.theta,
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_dtype="fp32",  # HF computes the router logits in fp32
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
    )
    if isinstance(rope, YarnRope):
        fields.update(rope_type="yarn", rotary_scaling_factor=rope.factor,
                      original_max_position_embeddings=rope.original_max_position_embeddings,
                      beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, mscale=rope.mscale,
                      mscale_all_dim=rope.mscale_all_dim)
    else:
        fields.update(rope_type="rope", mscale_all_dim=0.0)  # no YaRN: softmax scale 1/sqrt(qk_head_dim)
    return fields


_TE_FUSED_NORMS = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
_TE_REPLICATED = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def transformer_engine(param: ParamMap, dims: ModelDims, layer: int) -> ParamMap:
    """TE's MLA spec: latent norms fused into the up-projections, down-projections replicated
    (``TELinear``, duplicated), ``input_layernorm`` kept separate (there is no fused QKV)."""
    if param.megatron in _TE_FUSED_NORMS:
        return replace(param, megatron=_TE_FUSED_NORMS[param.megatron])
    if param.megatron in _TE_REPLICATED:
        return replace(param, mapping=Replicated(param.mapping.tensor))
    return fused_pre_mlp_norm(param, dims, layer)


def mtp_layers(config) -> re.Pattern | None:
    """The checkpoint names of the multi-token-prediction layers (skipped)."""
    count = getattr(config, "num_nextn_predict_layers", 0) or 0
    if not count:
        return None
    first = config.num_hidden_layers
    indices = "|".join(str(first + k) for k in range(count))
    return re.compile(rf"^model\.layers\.({indices})\.")


SPEC = FamilySpec(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    description="DeepSeek-V3: MLA, sigmoid group-limited routing with expert bias, shared expert, dense first layers",
    read_dims=read_dims,
    layer_params=layer_params,
    transformer_config=transformer_config,
    config_class="MLATransformerConfig",
    transformer_engine=transformer_engine,
    vllm_replicated=("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    vllm_hf_overrides=VLLM_HF_OVERRIDES,
    skipped_hf_tensors=mtp_layers,
)
