"""gpt-oss (GptOssForCausalLM): GQA with attention sinks and biases, sliding/full layers, MoE with biases
and a clamped SwiGLU.

Attention: grouped-query heads with a bias on q, k, v and the output projection (megatron's
``add_qkv_bias`` and ``add_bias_linear``); one learnable sink logit per head (HF ``self_attn.sinks``)
that joins each softmax denominator: megatron's ``softmax_type="learnable"``, whose
``core_attention.softmax_offset`` megarl's core attention computes exactly; the layers of
``layer_types`` ``sliding_attention`` see the ``sliding_window`` keys ending at the query
(megatron's ``window_size=(W - 1, 0)`` with ``window_attn_skip_freq`` as a per-layer list, so any
pattern is kept, not only gpt-oss's alternation).

MoE in every layer: the router is a linear layer with a bias; top-k of its logits, softmax over the
k (megatron's ``moe_router_pre_softmax=False``); each expert's up and down projections carry biases
(the output bias is scaled by the routing weight, as megatron's experts do). The activation is
``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``: megatron's
gated MLP with ``activation_func_clamp_value=L``, ``glu_linear_offset=1`` and ``quick_gelu``
(``alpha`` = 1.702; another alpha gets its own sigmoid gate).

The checkpoint packs each layer's experts into ``mlp.experts.gate_up_proj`` [experts, hidden,
2 * ffn] (transposed, gate and up interleaved by column), ``gate_up_proj_bias`` [experts, 2 * ffn],
``down_proj`` [experts, ffn, hidden] and ``down_proj_bias`` [experts, hidden]; the parameter maps
name one part per expert (``mlp.experts.<e>.{gate,up,down}_proj.{weight,bias}``) and
``packed_tensors`` says how they sit in those tensors (``megarl.models.packed``).

The published checkpoints store the two expert weights in MXFP4 (``<name>_blocks`` and ``<name>_scales``,
``quantization_config.quant_method='mxfp4'``); the loader dequantises them one expert at a time
(``megarl.models.mxfp4``), exactly, and an export writes the dequantised tensors.

RoPE: default, or YaRN as the published checkpoints set it (``truncate: false``, which megatron's
always-truncating ``YarnRotaryEmbedding`` cannot build): transformers' inverse frequencies are set
on megatron's rotary embedding and its cos/sin factor (``attention_factor``, 1.35 for factor 32)
scales q and k alike, so the softmax scale takes its square (``dims.TransformersRope``).

Refused, naming the field: ``attention_bias=False`` (megatron's ``add_bias_linear`` puts biases on
the attention output and the experts alike), other RoPE types, ``layer_types`` other than sliding/full attention.
The weight sync into vLLM refuses the family (``megarl.models.vllm_layout.vllm_splits``).
"""
from __future__ import annotations

import functools

import torch

from megarl.models.dims import ModelDims, MoE, TransformersRope, common_dims, gqa_attention, read_rope, rope_parameters
from megarl.models.families.base import FamilySpec, PackedTensor, ParamMap, attention_params, gqa_transformer_config
from megarl.models.families.base import layer_norm_params, per_expert
from megarl.models.mappings import FusedGateUp, HFTensor, Replicated, Split

QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu: x * sigmoid(1.702 x)
LAYER_TYPES = ("sliding_attention", "full_attention")


def _refuse(config, field: str, value, why: str) -> ValueError:
    return ValueError(f"{config.model_type}: {field}={value!r} is not supported by the megatron bridge: {why}")


def read_dims(config) -> ModelDims:
    if not config.attention_bias:
        raise _refuse(config, "attention_bias", False, "megatron's add_bias_linear gives the attention output "
                      "projection a bias whenever the experts have theirs")
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise _refuse(config, "layer_types", unknown, f"the bridge knows {list(LAYER_TYPES)}")
    windows = tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)
    rope, softmax_scale = _read_rope(config)
    attention = gqa_attention(config, qkv_bias=True, qk_norm=False, windows=windows, softmax_scale=softmax_scale)
    moe = MoE(num_experts=config.num_local_experts, ffn_hidden_size=config.intermediate_size,
              topk=config.num_experts_per_tok, layers=(True,) * config.num_hidden_layers, norm_topk_prob=True)
    return common_dims(config, attention=attention, rope=rope, moe=moe,
                       clamped_swiglu=(float(config.swiglu_limit), float(config.swiglu_alpha)))


def _read_rope(config) -> tuple:
    """(RoPE, softmax scale or None): default RoPE as is; YaRN (gpt-oss's published ``truncate: false`` too)
    with transformers' inverse frequencies and its cos/sin factor folded into the softmax scale."""
    rope_type, parameters = rope_parameters(config)
    if rope_type != "yarn":
        return read_rope(config, ("default", "yarn")), None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = TransformersRope(float(parameters["rope_theta"]), "yarn", float(attention_factor))
    return rope, head_dim ** -0.5 * rope.attention_factor ** 2


def _expert_names(i: int, e: int) -> dict[str, str]:
    p = f"model.layers.{i}.mlp.experts.{e}."
    return {k: f"{p}{k}" for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight",
                                    "gate_proj.bias", "up_proj.bias", "down_proj.bias")}


def layer_params(dims: ModelDims, i: int) -> list[ParamMap]:
    """Norms, biased attention with sinks, the biased router and each expert's biased projections."""
    p, h, ffn, moe = f"model.layers.{i}.", dims.hidden_size, dims.moe.ffn_hidden_size, dims.moe
    attention = attention_params(dims, i)  # linear_qkv weight and bias, linear_proj weight
    attention += [
        ParamMap("self_attention.linear_proj.bias", Replicated(HFTensor(p + "self_attn.o_proj.bias", (h,)))),
        ParamMap("self_attention.core_attention.softmax_offset",
                 Split(HFTensor(p + "self_attn.sinks", (dims.attention.num_heads,)), dim=0)),
    ]
    mlp = [ParamMap("mlp.router.weight", Replicated(HFTensor(p + "mlp.router.weight", (moe.num_experts, h)))),
           ParamMap("mlp.router.bias", Replicated(HFTensor(p + "mlp.router.bias", (moe.num_experts,))))]
    for e in range(moe.num_experts):
        n, local = _expert_names(i, e), "mlp.experts.local_experts.{expert}."
        mlp += [
            ParamMap(local + "linear_fc1.weight", FusedGateUp(HFTensor(n["gate_proj.weight"], (ffn, h)),
                                                              HFTensor(n["up_proj.weight"], (ffn, h))), e),
            ParamMap(local + "linear_fc1.bias", FusedGateUp(HFTensor(n["gate_proj.bias"], (ffn,)),
                                                            HFTensor(n["up_proj.bias"], (ffn,))), e),
            ParamMap(local + "linear_fc2.weight", Split(HFTensor(n["down_proj.weight"], (h, ffn)), dim=1), e),
            ParamMap(local + "linear_fc2.bias", Replicated(HFTensor(n["down_proj.bias"], (h,))), e),
        ]
    return layer_norm_params(dims, i) + attention + mlp


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate and up [..., ffn] -> [..., 2 * ffn] with gate at the even and up at the odd positions."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def packed_tensors(dims: ModelDims) -> list[PackedTensor]:
    """Each layer's four expert tensors (see the module docstring) and the per-expert parts they hold."""
    packed, h, ffn, experts = [], dims.hidden_size, dims.moe.ffn_hidden_size, dims.moe.num_experts
    for i in range(dims.num_layers):
        p, names = f"model.layers.{i}.mlp.experts.", [_expert_names(i, e) for e in range(experts)]
        gate_up, gate_up_bias, down, down_bias = {}, {}, {}, {}
        for e, n in enumerate(names):
            gate_up[n["gate_proj.weight"]] = (e, lambda row: row[:, 0::2].t())
            gate_up[n["up_proj.weight"]] = (e, lambda row: row[:, 1::2].t())
            gate_up_bias[n["gate_proj.bias"]] = (e, lambda row: row[0::2])
            gate_up_bias[n["up_proj.bias"]] = (e, lambda row: row[1::2])
            down[n["down_proj.weight"]] = (e, lambda row: row.t())
            down_bias[n["down_proj.bias"]] = (e, lambda row: row)
        packed += [
            PackedTensor(p + "gate_up_proj", (experts, h, 2 * ffn), gate_up, per_expert(
                names, lambda parts, n: _interleave(parts[n["gate_proj.weight"]].t(), parts[n["up_proj.weight"]].t()))),
            PackedTensor(p + "gate_up_proj_bias", (experts, 2 * ffn), gate_up_bias, per_expert(
                names, lambda parts, n: _interleave(parts[n["gate_proj.bias"]], parts[n["up_proj.bias"]]))),
            PackedTensor(p + "down_proj", (experts, ffn, h), down, per_expert(
                names, lambda parts, n: parts[n["down_proj.weight"]].t())),
            PackedTensor(p + "down_proj_bias", (experts, h), down_bias, per_expert(
                names, lambda parts, n: parts[n["down_proj.bias"]])),
        ]
    return packed


def prepare_layer_spec(layer_spec) -> None:
    """The local spec's experts get ``FreshOutputRowParallelLinear`` as ``linear_fc2``: megatron adds their
    output bias in place, which autograd refuses on the row-parallel output (``megarl.models.layers``)."""
    from dataclasses import replace

    from megatron.core.tensor_parallel import RowParallelLinear

    from megarl.models.layers import FreshOutputRowParallelLinear

    mlp = layer_spec.submodules.mlp
    experts = getattr(getattr(mlp, "submodules", None), "experts", None)
    if experts is not None and getattr(experts.submodules, "linear_fc2", None) is RowParallelLinear:
        experts = replace(experts, submodules=replace(experts.submodules, linear_fc2=FreshOutputRowParallelLinear))
        layer_spec.submodules.mlp = replace(mlp, submodules=replace(mlp.submodules, experts=experts))


def _sigmoid_gate(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)


def transformer_config(dims: ModelDims) -> dict:
    """GQA with biases and learnable sinks, per-layer windows, softmax top-k routing, the clamped SwiGLU."""
    from megatron.core.activations import quick_gelu

    windows = dims.attention.windows
    sizes = {w for w in windows if w is not None}
    fields = dict(gqa_transformer_config(dims), add_bias_linear=True, softmax_type="learnable",
                  moe_router_score_function="softmax", moe_router_pre_softmax=False, bias_activation_fusion=False,
                  glu_linear_offset=1.0, activation_func_clamp_value=dims.clamped_swiglu[0])
    alpha = dims.clamped_swiglu[1]
    fields["activation_func"] = quick_gelu if alpha == QUICK_GELU_ALPHA else functools.partial(_sigmoid_gate, alpha=alpha)
    if sizes:
        (window,) = sizes  # one sliding_window per config
        fields.update(window_size=(window - 1, 0), window_attn_skip_freq=[int(w is not None) for w in windows])
    return fields


def tiny_config(fields: dict, size: str):
    """gpt-oss's features on a tiny model: 8 experts top-2, a window of 5 on the first of each pair of
    layers, a SwiGLU clamp small enough to act on tiny random activations (see TINY_SWIGLU_LIMIT)."""
    from transformers import GptOssConfig

    layers = fields["num_hidden_layers"]
    rest = {k: v for k, v in fields.items() if k not in ("rope_parameters", "intermediate_size")}
    return GptOssConfig(**rest, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                        intermediate_size=fields["intermediate_size"] // 4, num_local_experts=8, num_experts_per_tok=2,
                        sliding_window=5, layer_types=[LAYER_TYPES[(i + 1) % 2 == 0] for i in range(layers)],
                        swiglu_limit=TINY_SWIGLU_LIMIT, attention_bias=True)


def vllm_refusal(config) -> str | None:
    """vLLM's gpt-oss model hard-codes what the published checkpoints set (vllm/model_executor/models/gpt_oss.py):
    the SwiGLU clamp (``swigluoai``: limit 7.0, alpha 1.702), a window on the even layers whatever
    ``layer_types`` says, and YaRN (it reads ``rope_parameters["factor"]``). Another value would be served other
    than transformers and the trainer compute it: refused, naming the field."""
    hard_coded = {"swiglu_limit": 7.0, "swiglu_alpha": QUICK_GELU_ALPHA}
    for field_name, value in hard_coded.items():
        if float(getattr(config, field_name, value)) != value:
            return (f"vLLM's gpt-oss computes the clamped SwiGLU with {field_name}={value} whatever the config says, "
                    f"and this checkpoint has {field_name}={getattr(config, field_name)}")
    expected = [LAYER_TYPES[i % 2] for i in range(config.num_hidden_layers)]
    if config.sliding_window and list(config.layer_types) != expected:
        return ("vLLM's gpt-oss puts the sliding window on the even layers whatever layer_types says, and this "
                f"checkpoint's layer_types are {list(config.layer_types)}")
    if rope_parameters(config)[0] != "yarn":
        return "vLLM's gpt-oss builds YaRN RoPE only, and this checkpoint's RoPE is not YaRN"
    return None


# The tiny seed-0 model's gate and up values reach 0.96 (measured, biases included); a limit of 0.3 clips the larger ones.
TINY_SWIGLU_LIMIT = 0.3

SPEC = FamilySpec(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    description="gpt-oss: attention sinks and biases, sliding/full layers, biased MoE with a clamped SwiGLU",
    read_dims=read_dims,
    layer_params=layer_params,
    transformer_config=transformer_config,
    packed_tensors=packed_tensors,
    vllm_takes_expert_rows=True,
    vllm_refusal=vllm_refusal,
    prepare_layer_spec=prepare_layer_spec,
    tiny_config=tiny_config,
    grouped_gemm_refusal=("gpt-oss's experts have biases and a clamped SwiGLU (glu_linear_offset=1), which "
                          "megatron-core's grouped experts cannot compute (GroupedMLP takes no bias and only a plain "
                          "silu/gelu GLU)"),
)
