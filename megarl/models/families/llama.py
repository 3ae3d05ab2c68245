"""Llama 3.x (LlamaForCausalLM): GQA, RMSNorm, SwiGLU, no biases, default or llama3 RoPE scaling."""
from megarl.models.dims import common_dims, gqa_attention, read_rope
from megarl.models.families.base import FamilySpec, gqa_family_config, llama_like_layer, reject_attention_bias


def read_dims(config):
    reject_attention_bias(config)
    return common_dims(config, attention=gqa_attention(config, qkv_bias=False, qk_norm=False), rope=read_rope(config))


SPEC = FamilySpec(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    description="Llama 3.x: GQA, RMSNorm, SwiGLU, no biases",
    read_dims=read_dims,
    layer_params=llama_like_layer,
    transformer_config=gqa_family_config,
)
