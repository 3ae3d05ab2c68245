"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): Qwen3-VL's
vision tower, DeepStack and interleaved M-RoPE (``qwen3_vl``) around a Qwen3-MoE language model (``qwen3_moe``).

Routing: softmax over the experts, top-k, always renormalised: transformers' router has no
``norm_topk_prob`` and divides by the sum whatever the config says. vLLM reads the field
(``renormalize=config.norm_topk_prob``), so a config with ``norm_topk_prob: false`` is refused (the two would
differ) and one without it is given ``true`` (``vllm_hf_overrides``). ``mlp_only_layers`` and
``decoder_sparse_step`` make some layers dense, as in Qwen3-MoE.

The checkpoint packs each MoE layer's experts into two tensors, as Qwen published them and transformers 5
writes them: ``mlp.experts.gate_up_proj`` [experts, hidden, 2 * ffn] (each expert's gate and up projections,
transposed, gate in the first ``ffn`` columns) and ``mlp.experts.down_proj`` [experts, ffn, hidden] (transposed).
The parameter maps are Qwen3-MoE's, one part per expert (``mlp.experts.<e>.{gate,up,down}_proj.weight``);
``packed_tensors`` says where each part sits (``megarl.models.packed``): the loader reads one expert's row, the
export packs them back bit for bit. vLLM's loader takes the per-expert names as well as the packed tensors, so
the weight sync sends the parts as it does Qwen3-MoE's (``vllm_takes_packed_parts``).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megarl.models.dims import ModelDims
from megarl.models.families import qwen3_moe, qwen3_vl
from megarl.models.families.base import PackedTensor, per_expert

VISION_CLASS = "Qwen3VLMoeVisionModel"


def read_dims(config) -> ModelDims:
    text = config.text_config
    if getattr(text, "norm_topk_prob", True) is False:
        raise ValueError(f"{config.model_type}: text_config.norm_topk_prob=false is not supported: transformers' "
                         "Qwen3-VL-MoE renormalises the top-k weights whatever it says, vLLM follows the field, so "
                         "the trainer and the rollout would route differently; remove it or set it to true")
    return qwen3_vl.vision_language(config, qwen3_moe.read_dims(text, norm_topk_prob=True), VISION_CLASS)


def _expert(i: int, e: int, prefix: str) -> dict[str, str]:
    p = f"{prefix}layers.{i}.mlp.experts.{e}."
    return {k: p + k for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}


def packed_tensors(dims: ModelDims) -> list[PackedTensor]:
    """Each MoE layer's ``gate_up_proj`` and ``down_proj`` (see the module docstring) and their per-expert parts."""
    packed, h, ffn, experts = [], dims.hidden_size, dims.moe.ffn_hidden_size, dims.moe.num_experts
    for i in range(dims.num_layers):
        if not dims.is_moe_layer(i):
            continue
        p, names = f"{dims.hf_prefix}layers.{i}.mlp.experts.", [_expert(i, e, dims.hf_prefix) for e in range(experts)]
        gate_up, down = {}, {}
        for e, n in enumerate(names):
            gate_up[n["gate_proj.weight"]] = (e, lambda row: row[:, :ffn].t())
            gate_up[n["up_proj.weight"]] = (e, lambda row: row[:, ffn:].t())
            down[n["down_proj.weight"]] = (e, lambda row: row.t())
        packed += [
            PackedTensor(p + "gate_up_proj", (experts, h, 2 * ffn), gate_up, per_expert(
                names, lambda parts, n: torch.cat((parts[n["gate_proj.weight"]].t(), parts[n["up_proj.weight"]].t()), dim=1))),
            PackedTensor(p + "down_proj", (experts, ffn, h), down, per_expert(
                names, lambda parts, n: parts[n["down_proj.weight"]].t())),
        ]
    return packed


SPEC = replace(
    qwen3_moe.SPEC,
    name="qwen3_vl_moe",
    architectures=("Qwen3VLMoeForConditionalGeneration",),
    model_types=("qwen3_vl_moe",),
    description="Qwen3-VL-MoE: Qwen3-MoE (fused experts in the checkpoint) with Qwen3-VL's tower, DeepStack and M-RoPE",
    read_dims=read_dims,
    packed_tensors=packed_tensors,
    vllm_takes_packed_parts=True,
    vllm_hf_overrides={"text_config": {"norm_topk_prob": True}},
)
