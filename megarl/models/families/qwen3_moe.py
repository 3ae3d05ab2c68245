"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, softmax top-k routing, optional dense layers.

Routing: softmax over all experts, top-k, then renormalise when ``norm_topk_prob`` (as in
Qwen3-30B-A3B / 235B-A22B); ``mlp_only_layers`` and ``decoder_sparse_step`` make some layers dense.
"""
from megarl.models.dims import MoE, ModelDims, common_dims, gqa_attention, read_rope
from megarl.models.families.base import (
    FamilySpec,
    attention_params,
    dense_mlp_params,
    gqa_family_config,
    layer_norm_params,
    moe_params,
    reject_attention_bias,
)


def _is_moe_layer(config, i: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return i not in (getattr(config, "mlp_only_layers", None) or []) and (i + 1) % step == 0


def read_dims(config, norm_topk_prob: bool | None = None):
    """``norm_topk_prob``: the routing's renormalisation where the model fixes it (Qwen3-VL-MoE always
    renormalises), else the config's field."""
    reject_attention_bias(config)
    moe = MoE(
        num_experts=config.num_experts,
        ffn_hidden_size=config.moe_intermediate_size,
        topk=config.num_experts_per_tok,
        layers=tuple(_is_moe_layer(config, i) for i in range(config.num_hidden_layers)),
        norm_topk_prob=bool(config.norm_topk_prob if norm_topk_prob is None else norm_topk_prob),
    )
    return common_dims(config, attention=gqa_attention(config, qkv_bias=False, qk_norm=True), rope=read_rope(config), moe=moe)


def layer_params(dims: ModelDims, i: int):
    p = f"model.layers.{i}.mlp."
    if dims.is_moe_layer(i):
        mlp = moe_params(dims, p + "gate.weight", p + "experts.{e}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
    else:
        mlp = dense_mlp_params(dims, i)
    return layer_norm_params(dims, i) + attention_params(dims, i) + mlp


SPEC = FamilySpec(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    description="Qwen3-MoE: qk-norm, softmax top-k routing (renormalised if norm_topk_prob)",
    read_dims=read_dims,
    layer_params=layer_params,
    transformer_config=gqa_family_config,
)
