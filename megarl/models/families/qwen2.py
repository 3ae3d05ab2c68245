"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama layout plus a bias on q, k and v (not on o)."""
from megarl.models.dims import common_dims, gqa_attention, read_rope
from megarl.models.families.base import FamilySpec, gqa_family_config, llama_like_layer


def read_dims(config):
    return common_dims(config, attention=gqa_attention(config, qkv_bias=True, qk_norm=False), rope=read_rope(config))


SPEC = FamilySpec(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    description="Qwen2/2.5: Llama layout plus QKV bias",
    read_dims=read_dims,
    layer_params=llama_like_layer,
    transformer_config=gqa_family_config,
)
