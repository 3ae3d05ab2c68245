"""What a model family declares, and the building blocks the Llama-like families share.

A family is a ``FamilySpec``: the HF architectures it serves, how to read its config into
``ModelDims``, and ``layer_params``: for decoder layer ``i``, the list of ``ParamMap`` entries
naming each megatron-core parameter of that layer (local layer-spec names, relative to
``decoder.layers.<n>.``) and the mapping from HF tensors that makes it. The top-level
parameters (embedding, final norm, output layer or value head) use the standard HF names and
live in ``megarl.models.shards``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from transformers import PretrainedConfig

from megarl.models.dims import ModelDims
from megarl.models.mappings import FusedGateUp, FusedQKV, HFTensor, Mapping, Replicated, Split


@dataclass(frozen=True)
class ParamMap:
    """One megatron parameter and the HF tensors it is made of.

    ``megatron`` is relative to the decoder layer; expert weights contain ``{expert}``, filled
    with the local expert index in stage-local names and the global one in global names.
    ``expert`` is the global expert index for expert weights (split over EP), else None.
    """

    megatron: str
    mapping: Mapping
    expert: int | None = None


@dataclass(frozen=True)
class FamilySpec:
    """A model family: adding one is one new module with one of these, registered in ``families``."""

    name: str
    architectures: tuple[str, ...]  # HF CausalLM architecture names it serves
    model_types: tuple[str, ...]  # HF model_type values (used when architectures is missing/other heads)
    description: str
    read_dims: Callable[[PretrainedConfig], ModelDims]
    layer_params: Callable[[ModelDims, int], list[ParamMap]]
    # Family-specific TransformerConfig fields on top of the ones derived from ModelDims.
    extra_transformer_config: Callable[[ModelDims], dict] = field(default=lambda dims: {})


def layer_norm_params(dims: ModelDims, i: int) -> list[ParamMap]:
    """The pre-attention and pre-MLP RMSNorms of a Llama-like layer."""
    p = f"model.layers.{i}."
    h = (dims.hidden_size,)
    return [
        ParamMap("input_layernorm.weight", Replicated(HFTensor(p + "input_layernorm.weight", h))),
        ParamMap("pre_mlp_layernorm.weight", Replicated(HFTensor(p + "post_attention_layernorm.weight", h))),
    ]


def attention_params(dims: ModelDims, i: int) -> list[ParamMap]:
    """GQA self-attention: fused QKV (optionally with bias), output projection, optional qk-norm."""
    p = f"model.layers.{i}.self_attn."
    hidden, q_size, kv_size = dims.hidden_size, dims.q_size, dims.kv_size
    groups = dict(num_groups=dims.num_query_groups, heads_per_group=dims.heads_per_group, head_dim=dims.head_dim)

    def qkv(suffix: str, tail: tuple[int, ...]) -> FusedQKV:
        return FusedQKV(
            HFTensor(f"{p}q_proj.{suffix}", (q_size, *tail)),
            HFTensor(f"{p}k_proj.{suffix}", (kv_size, *tail)),
            HFTensor(f"{p}v_proj.{suffix}", (kv_size, *tail)),
            **groups,
        )

    params = [ParamMap("self_attention.linear_qkv.weight", qkv("weight", (hidden,)))]
    if dims.qkv_bias:
        params.append(ParamMap("self_attention.linear_qkv.bias", qkv("bias", ())))
    params.append(ParamMap("self_attention.linear_proj.weight", Split(HFTensor(p + "o_proj.weight", (hidden, q_size)), dim=1)))
    if dims.qk_norm:
        d = (dims.head_dim,)
        params.append(ParamMap("self_attention.q_layernorm.weight", Replicated(HFTensor(p + "q_norm.weight", d))))
        params.append(ParamMap("self_attention.k_layernorm.weight", Replicated(HFTensor(p + "k_norm.weight", d))))
    return params


def swiglu_params(megatron_prefix: str, gate: str, up: str, down: str, hidden: int, ffn: int, expert: int | None = None) -> list[ParamMap]:
    """A SwiGLU MLP: fc1 = [gate; up] (column-parallel), fc2 = down (row-parallel)."""
    fc1 = FusedGateUp(HFTensor(gate, (ffn, hidden)), HFTensor(up, (ffn, hidden)))
    fc2 = Split(HFTensor(down, (hidden, ffn)), dim=1)
    return [
        ParamMap(megatron_prefix + "linear_fc1.weight", fc1, expert),
        ParamMap(megatron_prefix + "linear_fc2.weight", fc2, expert),
    ]


def dense_mlp_params(dims: ModelDims, i: int) -> list[ParamMap]:
    """The dense SwiGLU MLP at ``model.layers.<i>.mlp.{gate,up,down}_proj``."""
    p = f"model.layers.{i}.mlp."
    return swiglu_params(
        "mlp.", p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight", dims.hidden_size, dims.ffn_hidden_size
    )


def moe_params(dims: ModelDims, router: str, expert_prefix: str, gate: str, up: str, down: str) -> list[ParamMap]:
    """A MoE block: the router and each expert's SwiGLU MLP (megatron's SequentialMLP names).

    ``expert_prefix`` holds ``{e}``, the global expert index; gate/up/down are the expert's
    tensor names under it.
    """
    params = [ParamMap("mlp.router.weight", Replicated(HFTensor(router, (dims.num_experts, dims.hidden_size))))]
    for e in range(dims.num_experts):
        p = expert_prefix.format(e=e)
        params += swiglu_params(
            "mlp.experts.local_experts.{expert}.",
            p + gate,
            p + up,
            p + down,
            dims.hidden_size,
            dims.moe_ffn_hidden_size,
            expert=e,
        )
    return params


def llama_like_layer(dims: ModelDims, i: int) -> list[ParamMap]:
    """A Llama-like decoder layer with a dense MLP."""
    return layer_norm_params(dims, i) + attention_params(dims, i) + dense_mlp_params(dims, i)


def reject_attention_bias(config: PretrainedConfig) -> None:
    """Llama/Qwen3 ``attention_bias`` adds a bias to q, k, v and o; the bridge has no family using it."""
    if getattr(config, "attention_bias", False):
        raise ValueError(
            f"{config.model_type} with attention_bias=True is not supported (bias on the output projection); "
            "use a checkpoint without attention biases"
        )
