"""Mixtral (MixtralForCausalLM): Llama attention, every layer a MoE block with renormalised top-k.

HF names: ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.<e>.w1/w3/w2``
(gate/up/down). ``head_dim`` may be None in the config (then hidden/heads).
"""
from megarl.models.dims import MoE, ModelDims, common_dims, gqa_attention, read_rope
from megarl.models.families.base import FamilySpec, attention_params, gqa_family_config, layer_norm_params, moe_params


def read_dims(config):
    moe = MoE(
        num_experts=config.num_local_experts,
        ffn_hidden_size=config.intermediate_size,
        topk=config.num_experts_per_tok,
        layers=(True,) * config.num_hidden_layers,
        norm_topk_prob=True,  # Mixtral always renormalises the top-k probabilities
    )
    return common_dims(config, attention=gqa_attention(config, qkv_bias=False, qk_norm=False), rope=read_rope(config), moe=moe)


def layer_params(dims: ModelDims, i: int):
    p = f"model.layers.{i}.block_sparse_moe."
    mlp = moe_params(dims, p + "gate.weight", p + "experts.{e}.", "w1.weight", "w3.weight", "w2.weight")
    return layer_norm_params(dims, i) + attention_params(dims, i) + mlp


SPEC = FamilySpec(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    description="Mixtral: Llama attention, MoE in every layer, renormalised top-k",
    read_dims=read_dims,
    layer_params=layer_params,
    transformer_config=gqa_family_config,
)
