"""What a model is, counted from the bridge's own shard layout: parameters per rank, FLOPs, KV bytes.

Every count here comes from ``megarl.models`` (the same ``ModelDims`` and shard layout the
engine builds the model from, the same vLLM splits the weight sync uses), so a planned number
and an allocated tensor cannot disagree on what a parameter is: dense parameters split over TP,
experts over EP and expert-TP, uneven pipeline stages and virtual chunks, the tied output copy
on the last stage, the vocabulary padded as the bridge pads it.

``stage_params(model, layout, stage, role)`` lists one representative rank of a pipeline stage
(TP rank 0, EP rank 0: every TP and EP rank of a stage holds tensors of the same shapes), in
megatron's registration order, which the DDP buffer layout (``buffers``) depends on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from megarl.models.dims import MLAttention, ModelDims
from megarl.models.layout import ParallelLayout


@dataclass(frozen=True)
class ParamSlot:
    """One parameter tensor of one model chunk on one rank."""

    name: str
    numel: int
    chunk: int  # virtual pipeline chunk (one DDP instance, one set of buffers, each)
    expert: bool  # an expert parameter: its grads reduce over the expert-data-parallel group
    shared_embedding: bool  # the embedding / tied output copy across pipeline stages: its own DDP bucket


@dataclass(frozen=True)
class StageParams:
    """The tensors of one rank of pipeline stage ``stage``: parameters (megatron's order) and buffers."""

    stage: int
    params: tuple[ParamSlot, ...]
    fp32_buffer_numel: int  # module buffers kept in fp32 (the router's expert bias), not parameters

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


# Where a decoder-layer parameter sits in megatron's registration order (TransformerLayer, then
# SelfAttention / MLASelfAttention: linear_proj is registered before the input projections, the
# q/k/kv norms after them).
def _layer_rank(suffix: str) -> int:
    if suffix.startswith("input_layernorm"):
        return 0
    if suffix.startswith("self_attention.linear_proj"):
        return 1
    if suffix.startswith("self_attention.") and "layernorm" in suffix.split(".")[1]:
        return 3
    if suffix.startswith("self_attention."):
        return 2
    if suffix.startswith("pre_mlp_layernorm"):
        return 4
    return 5


def megatron_order(name: str) -> tuple:
    """A sort key giving megatron-core's ``named_parameters()`` order of a model chunk (stable within ranks)."""
    if name.startswith("embedding."):
        return (0,)
    if name.startswith("decoder.layers."):
        _, _, layer, suffix = name.split(".", 3)
        return (1, int(layer), _layer_rank(suffix))
    if name.startswith("decoder."):
        return (2,)
    return (3,)


class ModelFacts:
    """The model of a run (``ModelDims`` plus its HF config) and everything counted from it."""

    def __init__(self, hf_config):
        from megarl.models.families import family_for

        self.hf_config = hf_config
        self.family = family_for(hf_config)
        self.dims: ModelDims = self.family.read_dims(hf_config)
        self._stages: dict[tuple, StageParams] = {}
        self._checked: set[ParallelLayout] = set()

    # ------------------------------------------------------------------ per rank
    def stage_params(self, layout: ParallelLayout, stage: int, role: str = "actor") -> StageParams:
        """One rank of ``stage`` (TP rank 0, EP/ETP rank 0), every VPP chunk, in megatron's order."""
        key = (layout, stage, role)
        if key not in self._stages:
            self._stages[key] = self._stage_params(layout, stage, role)
        return self._stages[key]

    def _stage_params(self, layout: ParallelLayout, stage: int, role: str) -> StageParams:
        from megarl.models.shards import chunk_params, check_layout, place

        if layout not in self._checked:
            check_layout(self.dims, layout)  # a layout that cannot split this model fails by name
            self._checked.add(layout)
        slots, buffers = [], 0
        tied_across_stages = self.dims.tie_word_embeddings and layout.pp > 1 and role != "critic"
        for chunk in range(layout.vpp):
            params = chunk_params(self.dims, self.family, layout, stage, chunk, role, ep_rank=0)
            ordered = sorted(params, key=lambda p: megatron_order(p.name))
            for param in ordered:
                parts = layout.etp if param.expert is not None else layout.tp
                shape, _, _ = place(param.mapping, parts, 0)
                numel = math.prod(shape)
                if param.buffer:
                    buffers += numel
                    continue
                shared = tied_across_stages and param.name in ("embedding.word_embeddings.weight", "output_layer.weight")
                slots.append(ParamSlot(param.name, numel, chunk, param.expert is not None, shared))
        return StageParams(stage, tuple(slots), buffers)

    # ------------------------------------------------------------------ whole model
    @cached_property
    def _whole(self):
        """One pass over the whole model's parameters: HF shapes, vLLM splits, fp32 buffers."""
        from megarl.models.layout import ParallelLayout as Whole
        from megarl.models.shards import chunk_params
        from megarl.models.vllm_layout import splits_of_params

        params = chunk_params(self.dims, self.family, Whole(), 0, 0, "actor")
        shapes: dict[str, tuple[int, ...]] = {}
        for param in params:
            for tensor in param.mapping.tensors():
                shapes.setdefault(tensor.name, tensor.shape)
        fp32 = frozenset(t.name for p in params if p.buffer for t in p.mapping.tensors())
        return shapes, splits_of_params(params, self.family), fp32

    @property
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of the HF checkpoint (``megarl.models.hf_tensor_shapes``)."""
        return self._whole[0]

    @property
    def vllm_splits(self) -> dict:
        """HF name -> vLLM's TP split (``megarl.models.vllm_splits``)."""
        return self._whole[1]

    @property
    def fp32_tensors(self) -> frozenset[str]:
        """HF tensors the trainer keeps (and syncs) in fp32: module buffers (the expert bias)."""
        return self._whole[2]

    @cached_property
    def hf_params(self) -> int:
        """Parameters of the HF checkpoint (the published count)."""
        return sum(math.prod(s) for s in self.hf_shapes.values())

    @cached_property
    def largest_tensor(self) -> int:
        """Elements of the largest HF tensor (a receiver holds one whole while it assembles it)."""
        return max(math.prod(s) for s in self.hf_shapes.values())

    @cached_property
    def expert_params(self) -> int:
        """Parameters of the routed experts (all of them)."""
        return sum(math.prod(s) for n, s in self.hf_shapes.items() if is_routed_expert(n))

    @cached_property
    def vision_params(self) -> int:
        """Parameters of a vision-language model's vision tower (0 for a text model): megatron holds all of them
        on every TP rank of the first pipeline stage (``stage_params`` counts them there); vLLM splits them."""
        if self.dims.vision is None:
            return 0
        return sum(math.prod(s) for n, s in self.hf_shapes.items() if n.startswith(self.dims.vision.hf_prefix))

    @property
    def active_params(self) -> int:
        """Parameters one text token runs through: all but the routed experts it is not sent to, and but the
        vision tower (which runs on image patches)."""
        moe = self.dims.moe
        language = self.hf_params - self.vision_params
        if moe is None:
            return language
        return language - self.expert_params + self.expert_params * moe.topk // moe.num_experts

    @property
    def embedding_params(self) -> int:
        """The input embedding: a lookup, no matmul FLOPs."""
        return self.dims.vocab_size * self.dims.hidden_size

    def forward_flops_per_token(self, context: float) -> float:
        """FLOPs of one token's forward pass (2 per weight it multiplies, plus causal attention over
        ``context`` earlier positions on average)."""
        dims, attention = self.dims, self.dims.attention
        matmul = 2 * (self.active_params - self.embedding_params)
        if isinstance(attention, MLAttention):
            per_head = attention.qk_head_dim + attention.v_head_dim
        else:
            per_head = 2 * attention.head_dim
        return matmul + 2 * per_head * attention.num_heads * context * dims.num_layers

    # ------------------------------------------------------------------ the rollout engine
    def kv_bytes_per_token(self, rollout_tp: int, itemsize: int) -> int:
        """KV-cache bytes per token on one vLLM worker (``ModelDims.kv_bytes_per_token``)."""
        return self.dims.kv_bytes_per_token(rollout_tp, itemsize)

    def vllm_weight_bytes(self, rollout_tp: int, itemsize: int) -> int:
        """Weight bytes on vLLM's TP rank 0 (the largest): its region of every HF tensor by vLLM's
        TP split, the vocabulary padded to a multiple of 64 as vLLM pads it."""
        from megarl.models.vllm_layout import VOCAB_PADDING

        total = 0
        for (kind, shape, fp32), count in self.vllm_tensor_kinds.items():
            size = itemsize if not fp32 else 4
            if kind == "vocab" and rollout_tp > 1:
                rows = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING // rollout_tp
                numel = rows * math.prod(shape[1:])
            else:
                numel = region_numel(self.vllm_split(kind), shape, rollout_tp, 0)
            total += count * numel * size
        return total

    @cached_property
    def vllm_tensor_kinds(self) -> dict[tuple, int]:
        """(split kind or its repr, shape, fp32) -> number of HF tensors: most share a few shapes."""
        counts: dict[tuple, int] = {}
        for name, shape in self.hf_shapes.items():
            key = (split_key(self.vllm_splits[name]), tuple(shape), name in self.fp32_tensors)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def vllm_split(self, key):
        from megarl.models.vllm_layout import VllmSplit

        kind, heads = key if isinstance(key, tuple) else (key, 0)
        return VllmSplit(kind, heads)


def split_key(split) -> tuple[str, int] | str:
    return (split.kind, split.num_kv_heads) if split.kind == "kv_heads" else split.kind


def region_numel(split, shape: tuple[int, ...], tp: int, tp_rank: int) -> int:
    region = split.region("", shape, tp, tp_rank)
    return math.prod(stop - start for start, stop in region) if region else 0


def is_routed_expert(hf_name: str) -> bool:
    """A routed expert's weight (``...experts.<e>...``; shared experts are dense)."""
    parts = hf_name.split(".")
    return any(p == "experts" and i + 1 < len(parts) and parts[i + 1].isdigit() for i, p in enumerate(parts))


def is_ffn_projection(hf_name: str) -> bool:
    """The dense-MLP and expert FFN projections NeMo-RL's bulk refit path resharded shard to shard
    (``gate/up/down_proj.weight``, and Mixtral's ``w1/w2/w3``); shared experts excluded, as theirs."""
    if ".shared_expert" in hf_name or not hf_name.endswith(".weight"):
        return False
    leaf = hf_name.rsplit(".", 2)[-2]
    return leaf in ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
