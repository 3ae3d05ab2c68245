"""megatron-core TransformerConfig and GPTModel arguments that reproduce an HF model.

The fields shared by every family (depth, width, norms, the gated MLP's activation, the softmax
scale, parallel sizes, MoE sizes) are derived from ``ModelDims`` here; the family adds its own (attention, RoPE, routing), then come
the platform's CPU flags and the caller's overrides, in that order. The config class is the
family's (``TransformerConfig``, or ``MLATransformerConfig`` for DeepSeek-V3). MoE defaults:
no load-balancing loss and aux loss 0 (pass overrides to train with one).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from megarl.models.dims import DefaultRope, GQAttention, LinearRope, Llama3Rope, ModelDims, TransformersRope
from megarl.models.families import FamilySpec
from megarl.models.layout import ParallelLayout

DISPATCHERS = ("alltoall", "allgather")
# ModelDims.activation -> the gated MLP's activation (megatron applies it to the gate half of fc1)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def transformer_config_kwargs(
    dims: ModelDims,
    family: FamilySpec,
    layout: ParallelLayout,
    params_dtype: torch.dtype = torch.float32,
    moe_token_dispatcher: str = "alltoall",
    init_method_std: float = 0.02,
) -> dict:
    """The TransformerConfig fields of the model, before platform flags and user overrides."""
    if moe_token_dispatcher not in DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher={moe_token_dispatcher!r}; expected one of {DISPATCHERS}")
    kwargs = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.attention.num_heads,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[dims.activation],
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        init_method_std=init_method_std,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
    )
    if isinstance(dims.attention, GQAttention) and dims.attention.softmax_scale is not None:
        kwargs["softmax_scale"] = dims.attention.softmax_scale
    if dims.moe is not None:
        kwargs.update(
            num_moe_experts=dims.moe.num_experts,
            moe_ffn_hidden_size=dims.moe.ffn_hidden_size,
            moe_router_topk=dims.moe.topk,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type=moe_token_dispatcher,
            moe_layer_freq=[int(flag) for flag in dims.moe.layers],
            moe_grouped_gemm=False,  # SequentialMLP unless overridden (``megarl.models.grouped_experts``)
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )
    kwargs.update(family.transformer_config(dims))
    return kwargs


def build_transformer_config(kwargs: dict, platform_overrides: dict, overrides: dict | None, config_class: str = "TransformerConfig"):
    """The family's config class from derived fields, then platform flags, then the caller's overrides."""
    from megatron.core import transformer

    merged = {**kwargs, **platform_overrides, **(overrides or {})}
    cls = getattr(transformer, config_class)
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown {config_class} field(s) {unknown} in megatron-core; check the override names")
    return cls(**merged)


def gpt_model_kwargs(dims: ModelDims, layout: ParallelLayout, role: str) -> dict:
    """GPTModel arguments other than config/spec/pre/post: (padded) vocab, positions, RoPE, tying.

    Llama-3 and linear RoPE are built unscaled here and get transformers' exact inverse frequencies
    after the build (``megarl.models.build``); megatron-core's own llama3 scaling fixes its parameters.
    MLA families carry their RoPE in the config (GPTModel builds none for them).
    """
    kwargs = dict(
        vocab_size=layout.padded_vocab_size(dims.vocab_size),
        max_sequence_length=dims.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=dims.rotary_percent,
        share_embeddings_and_output_weights=dims.tie_word_embeddings and role != "critic",
        parallel_output=True,
    )
    if isinstance(dims.rope, (DefaultRope, LinearRope, Llama3Rope, TransformersRope)):
        kwargs["rotary_base"] = dims.rope.theta
    return kwargs
