"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): GQA with partial RoPE, QKV bias and qk-norm; DeepSeek-V3's routing.

Attention: grouped-query heads; ``attention_bias`` puts a bias on q, k and v only (the output
projection has none: megatron's ``add_qkv_bias``); ``use_qk_norm`` RMS-normalises each head's q and
k before RoPE (Qwen3's qk-norm); RoPE rotates the first ``partial_rotary_factor`` of each head's
channels (0.5: half of 128), as megatron's ``rotary_percent`` does.

MoE, as DeepSeek-V3's: sigmoid scores plus the fp32 ``e_score_correction_bias`` for the choice only
(megatron's ``mlp.router.expert_bias`` buffer, updated every step and carried by the sync),
group-limited top-k when ``topk_group < n_group`` (GLM-4.5 and 4.6 keep one group whole), weights
renormalised and multiplied by ``routed_scaling_factor``, a shared expert, the first
``first_k_dense_replace`` layers dense; the router runs in fp32 as in HF. Tensor names are
DeepSeek-V3's (``mlp.gate``, ``mlp.experts.<e>.*``, ``mlp.shared_experts.*``).

The multi-token-prediction layer of the checkpoints (``model.layers.<num_hidden_layers>.*``,
``num_nextn_predict_layers`` of them) is skipped and named in a log line, as for DeepSeek-V3.

Refused, naming the field: ``norm_topk_prob=False`` and group-limited routing megatron cannot
reproduce (``num_experts_per_tok / topk_group != 2`` with groups dropped), RoPE scaling.
"""
from __future__ import annotations

from megarl.models.dims import ModelDims, MoE, common_dims, gqa_attention, read_rope, rope_parameters
from megarl.models.families.base import FamilySpec, attention_params, gqa_transformer_config, layer_norm_params
from megarl.models.families.deepseek_v3 import deepseek_mlp_params, mtp_layers


def _refuse(config, field: str, value, why: str) -> ValueError:
    return ValueError(f"{config.model_type}: {field}={value!r} is not supported by the megatron bridge: {why}")


def _read_moe(config) -> MoE:
    if not config.norm_topk_prob:
        raise _refuse(config, "norm_topk_prob", False, "megatron-core always renormalises sigmoid top-k scores")
    experts, groups, kept, topk = config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok
    if experts % groups:
        raise _refuse(config, "n_group", groups, f"n_routed_experts={experts} must split into equal groups")
    limited = kept < groups
    if limited and topk != 2 * kept:
        raise _refuse(config, "num_experts_per_tok / topk_group", f"{topk}/{kept}", "megatron-core scores a group by "
                      "its top (num_experts_per_tok / topk_group) experts, GLM by its top 2: the ratio must be 2 "
                      "whenever groups are dropped (topk_group < n_group)")
    dense = config.first_k_dense_replace
    return MoE(num_experts=experts, ffn_hidden_size=config.moe_intermediate_size, topk=topk,
               layers=tuple(i >= dense for i in range(config.num_hidden_layers)), norm_topk_prob=True,
               score_function="sigmoid", num_groups=groups if limited else None, group_topk=kept if limited else None,
               scaling_factor=float(config.routed_scaling_factor), expert_bias=True,
               shared_expert_ffn_hidden_size=config.moe_intermediate_size * (config.n_shared_experts or 0))


def read_dims(config) -> ModelDims:
    _, parameters = rope_parameters(config)
    partial = float(parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    attention = gqa_attention(config, qkv_bias=bool(config.attention_bias), qk_norm=bool(config.use_qk_norm))
    if (attention.head_dim * partial) % 2:
        raise _refuse(config, "partial_rotary_factor", partial, f"head_dim={attention.head_dim} times it must be even")
    return common_dims(config, attention=attention, rope=read_rope(config, ("default",)), moe=_read_moe(config),
                       rotary_percent=partial)


def layer_params(dims: ModelDims, i: int):
    return layer_norm_params(dims, i) + attention_params(dims, i) + deepseek_mlp_params(dims, i)


def transformer_config(dims: ModelDims) -> dict:
    """GQA fields plus DeepSeek-V3's routing: sigmoid, expert bias, groups, scaling, fp32, shared expert."""
    moe: MoE = dims.moe
    return dict(
        gqa_transformer_config(dims),
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
    )


def tiny_config(fields: dict, size: str):
    """GLM-4.5's features on a tiny model: half-rotary heads, QKV bias, qk-norm, 8 experts in 2 groups
    (the best group kept, top-2 in it: group-limited, as GLM-4.5-Air's configs allow) with a shared
    expert, the first layer dense (no MTP layer)."""
    from transformers import Glm4MoeConfig

    rest = {k: v for k, v in fields.items() if k != "rope_parameters"}
    return Glm4MoeConfig(**rest, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
                         attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                         topk_group=1, n_shared_experts=1, moe_intermediate_size=fields["intermediate_size"] // 4,
                         routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                         num_nextn_predict_layers=0)


SPEC = FamilySpec(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    description="GLM-4.5/4.6: partial RoPE, QKV bias, qk-norm; sigmoid routing with expert bias, shared expert",
    read_dims=read_dims,
    layer_params=layer_params,
    transformer_config=transformer_config,
    skipped_hf_tensors=mtp_layers,
    tiny_config=tiny_config,
)
