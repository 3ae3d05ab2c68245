"""Qwen3 dense (Qwen3ForCausalLM): Llama layout plus per-head RMSNorm on q and k (qk-norm)."""
from megarl.models.dims import common_dims, gqa_attention, read_rope
from megarl.models.families.base import FamilySpec, gqa_family_config, llama_like_layer, reject_attention_bias


def read_dims(config):
    reject_attention_bias(config)
    return common_dims(config, attention=gqa_attention(config, qkv_bias=False, qk_norm=True), rope=read_rope(config))


SPEC = FamilySpec(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    description="Qwen3 dense: qk-norm (per-head RMSNorm on q and k), no biases",
    read_dims=read_dims,
    layer_params=llama_like_layer,
    transformer_config=gqa_family_config,
)
