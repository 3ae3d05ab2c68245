"""megatron-core TransformerConfig and GPTModel arguments that reproduce an HF model.

Every field is derived from ``ModelDims`` (plus the family's extra fields, the platform's CPU
flags and the caller's overrides, in that order). MoE routing is set to match HF exactly:

* softmax top-k with renormalisation (Mixtral; Qwen3-MoE with ``norm_topk_prob``): megatron's
  ``moe_router_pre_softmax=False`` = top-k on the logits, then softmax over the k chosen =
  HF's softmax -> top-k -> divide by the sum. (``True`` here measured 6.2e-2 logits error on Mixtral.)
* softmax top-k without renormalisation (``norm_topk_prob=False``): ``moe_router_pre_softmax=True``.
* no load-balancing loss and aux loss 0 by default (pass overrides to train with one).
* ``moe_router_dtype`` stays unset: the router logits are computed in the model dtype, as in HF
  (and megatron-core 0.16.1's fp32 router GEMM path needs Transformer Engine).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megarl.models.dims import ModelDims
from megarl.models.families import FamilySpec
from megarl.models.layout import ParallelLayout

DISPATCHERS = ("alltoall", "allgather")


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
        num_attention_heads=dims.num_attention_heads,
        num_query_groups=dims.num_query_groups,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
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
        sequence_parallel=layout.sequence_parallel,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
    )
    if dims.is_moe:
        kwargs.update(
            num_moe_experts=dims.num_experts,
            moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
            moe_router_topk=dims.moe_topk,
            moe_router_pre_softmax=not dims.moe_norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type=moe_token_dispatcher,
            moe_layer_freq=[int(flag) for flag in dims.moe_layers],
            moe_grouped_gemm=False,  # SequentialMLP: per-expert parameters with per-expert names
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )
    kwargs.update(family.extra_transformer_config(dims))
    return kwargs


def build_transformer_config(kwargs: dict, platform_overrides: dict, overrides: dict | None):
    """A TransformerConfig from derived fields, then platform flags, then the caller's overrides."""
    from megatron.core.transformer import TransformerConfig

    merged = {**kwargs, **platform_overrides, **(overrides or {})}
    if merged.get("moe_grouped_gemm"):
        raise ValueError(
            "moe_grouped_gemm=True is not supported by the bridge: its names map per-expert weights "
            "(SequentialMLP); leave moe_grouped_gemm unset"
        )
    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown TransformerConfig field(s) {unknown} in megatron-core; check the override names")
    return TransformerConfig(**merged)


def gpt_model_kwargs(dims: ModelDims, role: str) -> dict:
    """GPTModel arguments other than config/spec/pre/post: vocab, positions, RoPE, tying."""
    return dict(
        vocab_size=dims.vocab_size,
        max_sequence_length=dims.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=dims.rope_theta,
        rotary_percent=1.0,
        rope_scaling=dims.rope_llama3_factor is not None,
        rope_scaling_factor=dims.rope_llama3_factor or 8.0,
        share_embeddings_and_output_weights=dims.tie_word_embeddings and role != "critic",
        parallel_output=True,
    )
