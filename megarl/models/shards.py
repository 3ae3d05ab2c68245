"""The shard layout: for every megatron parameter on every rank, exactly which HF elements it holds.

This is the public, process-free description of a megatron-core model that the loader, the
exporter, the weight-sync planner and the conversion tools share. It is a pure function of
(HF config, ``ParallelLayout``, role).

A ``ShardSpec`` is one parameter tensor on one rank (one model chunk): its megatron names, its
owner coordinates and a list of ``HFPiece``s. Each piece says: the region ``megatron_slice`` of
the local tensor equals the region ``hf_slice`` of the HF tensor ``hf_name``. Pieces of one spec
tile its local tensor exactly.

Owners and replicas:
  * Dense params (``ep_rank is None``) are split over TP ranks (``tp_rank``) and identical on every
    data-parallel rank (EP ranks included). Expert params are split over expert-TP ranks
    (``etp_rank``), live on one EP rank (``ep_rank``) and are identical on every expert-data-parallel
    rank.
  * A param replicated over TP (norms, router, value head: ``split_dim is None``) appears once per
    TP rank; the copy on TP rank 0 is ``primary`` and is the one to read from when sending. The
    tied output layer of the last stage (PP > 1 with tied embeddings) mirrors the first stage's
    embedding and is never primary.
  * Over the primary specs of all ranks, every element of every HF tensor is covered exactly once.
  * The embedding and output layer hold the vocabulary padded to ``layout.padded_vocab_size``;
    the padding rows (``ShardSpec.padding``) come from no HF tensor: they are zeroed when loading,
    never exported or synced, and their logits are masked.
  * A buffer spec (``buffer=True``, the router's expert bias) is a module buffer, not a parameter.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from transformers import PretrainedConfig

from megarl.models.dims import ModelDims, load_hf_config
from megarl.models.families import FamilySpec, ParamMap, family_for
from megarl.models.layout import ParallelLayout
from megarl.models.mappings import HFTensor, Mapping, Replicated, VocabSplit, renamed

ROLES = ("actor", "ref", "critic")
TRANSFORMER_IMPLS = ("local", "transformer_engine")

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"
VALUE_HEAD_WEIGHT = "output_layer.weight"
VALUE_HEAD_BIAS = "output_layer.bias"
VISION_TOWER = "visual."  # a vision-language model's tower (``ModelDims.vision``), under its HF names
# HF names of the value head: AutoModelForTokenClassification(num_labels=1)'s ``score`` layer.
HF_VALUE_WEIGHT = "score.weight"
HF_VALUE_BIAS = "score.bias"


@dataclass(frozen=True)
class HFPiece:
    """``local_tensor[megatron_slice] == hf_tensor[hf_slice]``, for the HF tensor ``hf_name``."""

    hf_name: str
    hf_shape: tuple[int, ...]
    hf_slice: tuple[slice, ...]
    megatron_slice: tuple[slice, ...]


@dataclass(frozen=True)
class ShardSpec:
    """One megatron parameter tensor on one rank, and the HF pieces it is made of."""

    name: str  # as in the model chunk's named_parameters(): stage-local layer, local expert index
    global_name: str  # global layer index and global expert index
    local_shape: tuple[int, ...]
    pp_stage: int
    vpp_chunk: int
    tp_rank: int | None  # dense params: TP rank; None for expert params
    ep_rank: int | None  # expert params: EP rank; None for dense params
    etp_rank: int | None  # expert params: expert-TP rank; None for dense params
    split_dim: int | None  # the dim split over TP (or expert-TP); None when replicated
    primary: bool  # the copy to read from when every element must be sent once
    pieces: tuple[HFPiece, ...]
    padding: tuple[slice, ...] | None = None  # the local region holding vocabulary padding (no HF data)
    buffer: bool = False  # a module buffer (the router's fp32 expert bias), not a parameter

    @property
    def is_expert(self) -> bool:
        return self.ep_rank is not None


@dataclass(frozen=True)
class ModelParam:
    """A megatron parameter of one model chunk before it is placed on ranks."""

    name: str
    global_name: str
    mapping: Mapping
    expert: int | None = None
    primary: bool = True
    buffer: bool = False


def model_dims(hf_config_or_dir) -> ModelDims:
    """The ``ModelDims`` of an HF config or model directory (through its family)."""
    config = load_hf_config(hf_config_or_dir)
    return family_for(config).read_dims(config)


def check_layout(dims: ModelDims, layout: ParallelLayout) -> None:
    """Raise a ValueError naming the problem when ``layout`` cannot split this model exactly."""
    problems = list(dims.attention.tp_problems(layout.tp))
    if dims.has_dense_layers and dims.ffn_hidden_size % layout.tp:
        problems.append(f"intermediate_size={dims.ffn_hidden_size} is not divisible by tp={layout.tp}")
    if dims.moe is not None:
        if dims.moe.num_experts % layout.ep:
            problems.append(f"num_experts={dims.moe.num_experts} is not divisible by ep={layout.ep}")
        if dims.moe.ffn_hidden_size % layout.etp:
            problems.append(f"expert ffn size {dims.moe.ffn_hidden_size} is not divisible by etp={layout.etp}")
        if dims.moe.shared_expert_ffn_hidden_size % layout.tp:
            problems.append(f"shared expert ffn size {dims.moe.shared_expert_ffn_hidden_size} is not divisible by tp={layout.tp}")
    elif layout.ep > 1 or layout.etp > 1:
        problems.append(f"ep={layout.ep}, etp={layout.etp} need a MoE model; set both to 1 for a dense model")
    if dims.mrope is not None and layout.cp > 1:
        problems.append(f"cp={layout.cp}: M-RoPE under context parallelism is not supported; use cp=1")
    if problems:
        raise ValueError(f"layout {layout} cannot split this model: " + "; ".join(problems))
    layout.stage_layer_counts(dims.num_layers)  # raises on an impossible pipeline split
    deepstack = dims.vision.deepstack_layers if dims.vision is not None else 0
    if deepstack > len(layout.chunk_layers(dims.num_layers, 0, 0)):
        raise ValueError(f"layout {layout} cannot split this model: the first {deepstack} layers take the vision "
                         "tower's DeepStack features and must be on the first pipeline stage (chunk); give it more "
                         "layers (num_layers_in_first_pipeline_stage)")


def _layer_param(family: FamilySpec, dims: ModelDims, param: ParamMap, layer: int, impl: str) -> ParamMap:
    return family.transformer_engine(param, dims, layer) if impl == "transformer_engine" else param


def _layer_name(layer_index: int, param: ParamMap, expert_index: int | None) -> str:
    suffix = param.megatron
    if param.expert is not None:
        suffix = suffix.format(expert=expert_index)
    return f"decoder.layers.{layer_index}.{suffix}"


def chunk_params(
    dims: ModelDims,
    family: FamilySpec,
    layout: ParallelLayout,
    pp_stage: int,
    vpp_chunk: int,
    role: str = "actor",
    transformer_impl: str = "local",
    ep_rank: int | None = None,
) -> list[ModelParam]:
    """The megatron parameters of one model chunk, in model order.

    ``ep_rank`` limits expert weights to the experts of that EP rank (None: all experts, named by
    the local index they have on their own EP rank).
    """
    if role not in ROLES:
        raise ValueError(f"role={role!r}; expected one of {ROLES}")
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={transformer_impl!r}; expected one of {TRANSFORMER_IMPLS}")
    first, last = layout.is_first_chunk(pp_stage, vpp_chunk), layout.is_last_chunk(pp_stage, vpp_chunk)
    vocab = (dims.vocab_size, dims.hidden_size)
    padded = layout.padded_vocab_size(dims.vocab_size)
    embedding = VocabSplit(HFTensor("model.embed_tokens.weight", vocab), padded)
    params: list[ModelParam] = []
    if first:
        params.append(ModelParam(EMBEDDING, EMBEDDING, embedding))
        if dims.vision is not None:
            for name, shape in dims.vision.tensors:
                tower = Replicated(HFTensor(dims.vision.hf_prefix + name, shape))
                params.append(ModelParam(VISION_TOWER + name, VISION_TOWER + name, tower))
    for local, layer in enumerate(layout.chunk_layers(dims.num_layers, pp_stage, vpp_chunk)):
        for param in family.layer_params(dims, layer):
            param = _layer_param(family, dims, param, layer, transformer_impl)
            local_expert = None
            if param.expert is not None:
                owner, local_expert = layout.expert_owner(dims.moe.num_experts, param.expert)
                if ep_rank is not None and owner != ep_rank:
                    continue
            params.append(
                ModelParam(
                    name=_layer_name(local, param, local_expert),
                    global_name=_layer_name(layer, param, param.expert),
                    mapping=param.mapping,
                    expert=param.expert,
                    buffer=param.buffer,
                )
            )
    if last:
        params.append(ModelParam(FINAL_NORM, FINAL_NORM, Replicated(HFTensor("model.norm.weight", (dims.hidden_size,)))))
        if role == "critic":
            weight = Replicated(HFTensor(HF_VALUE_WEIGHT, (1, dims.hidden_size)))
            params.append(ModelParam(VALUE_HEAD_WEIGHT, VALUE_HEAD_WEIGHT, weight))
            params.append(ModelParam(VALUE_HEAD_BIAS, VALUE_HEAD_BIAS, Replicated(HFTensor(HF_VALUE_BIAS, (1,)))))
        elif not dims.tie_word_embeddings:
            lm_head = VocabSplit(HFTensor("lm_head.weight", vocab), padded)
            params.append(ModelParam(OUTPUT_LAYER, OUTPUT_LAYER, lm_head))
        elif not first:
            # Tied embeddings across stages: the last stage keeps a copy of the embedding.
            params.append(ModelParam(OUTPUT_LAYER, OUTPUT_LAYER, embedding, primary=False))
    if dims.hf_prefix != "model.":
        params = [replace(p, mapping=renamed(p.mapping, lambda name: language_name(dims, name))) for p in params]
    return params


def language_name(dims: ModelDims, name: str) -> str:
    """The checkpoint name of a language-model tensor the family's maps name under ``model.``
    (``ModelDims.hf_prefix``: Qwen3-VL's ``model.language_model.``); other names are kept."""
    if name.startswith("model.") and not (dims.vision is not None and name.startswith(dims.vision.hf_prefix)):
        return dims.hf_prefix + name[len("model."):]
    return name


def _full(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def place(mapping: Mapping, parts: int, rank: int) -> tuple[tuple[int, ...], tuple[HFPiece, ...], tuple[slice, ...] | None]:
    """(local shape, pieces, padding region or None) of ``mapping`` on split rank ``rank`` of ``parts``."""
    dim = mapping.split_dim
    pieces, offset = [], 0
    for block in mapping.blocks(parts, rank):
        shape = block.tensor.shape
        if dim is None:
            hf_slice = megatron_slice = _full(shape)
        else:
            rows = block.stop - block.start
            hf_slice = tuple(slice(block.start, block.stop) if d == dim else slice(0, n) for d, n in enumerate(shape))
            megatron_slice = tuple(slice(offset, offset + rows) if d == dim else slice(0, n) for d, n in enumerate(shape))
            offset += rows
        pieces.append(HFPiece(block.tensor.name, shape, hf_slice, megatron_slice))
    local_shape = list(mapping.tensors()[0].shape)
    padding = None
    if isinstance(mapping, VocabSplit):
        local_shape[0] = mapping.local_rows(parts)
        if offset < local_shape[0]:
            padding = (slice(offset, local_shape[0]),) + _full(tuple(local_shape[1:]))
    elif dim is not None:
        local_shape[dim] = offset
    return tuple(local_shape), tuple(pieces), padding


def _rank_specs(
    params: list[ModelParam],
    layout: ParallelLayout,
    dims: ModelDims,
    pp_stage: int,
    vpp_chunk: int,
    tp_ranks: range | list[int],
    etp_ranks: range | list[int],
) -> Iterator[ShardSpec]:
    for param in params:
        split = param.mapping.split_dim is not None
        if param.expert is None:
            owners = [(t, None, None, layout.tp, t) for t in tp_ranks]
        else:
            ep_rank, _ = layout.expert_owner(dims.moe.num_experts, param.expert)
            owners = [(None, ep_rank, t, layout.etp, t) for t in etp_ranks]
        for tp_rank, ep_rank, etp_rank, parts, rank in owners:
            shape, pieces, padding = place(param.mapping, parts, rank)
            yield ShardSpec(
                param.name, param.global_name, shape, pp_stage, vpp_chunk, tp_rank, ep_rank, etp_rank,
                param.mapping.split_dim, param.primary and (split or rank == 0), pieces, padding, param.buffer,
            )


def param_shards(
    hf_config_or_dir: PretrainedConfig | str,
    layout: ParallelLayout,
    role: str = "actor",
    transformer_impl: str = "local",
) -> list[ShardSpec]:
    """Every parameter shard of one model replica: all PP stages, VPP chunks, TP, EP and ETP ranks."""
    config = load_hf_config(hf_config_or_dir)
    family = family_for(config)
    dims = family.read_dims(config)
    check_layout(dims, layout)
    specs = []
    for pp_stage in range(layout.pp):
        for vpp_chunk in range(layout.vpp):
            params = chunk_params(dims, family, layout, pp_stage, vpp_chunk, role, transformer_impl)
            specs.extend(_rank_specs(params, layout, dims, pp_stage, vpp_chunk, range(layout.tp), range(layout.etp)))
    return specs


def rank_shards(
    hf_config_or_dir: PretrainedConfig | str,
    layout: ParallelLayout,
    pp_stage: int,
    tp_rank: int,
    ep_rank: int = 0,
    etp_rank: int = 0,
    role: str = "actor",
    transformer_impl: str = "local",
) -> list[ShardSpec]:
    """The shards held by one rank (all of its VPP chunks), replicas included (``primary=False``)."""
    config = load_hf_config(hf_config_or_dir)
    family = family_for(config)
    dims = family.read_dims(config)
    check_layout(dims, layout)
    specs = []
    for vpp_chunk in range(layout.vpp):
        params = chunk_params(dims, family, layout, pp_stage, vpp_chunk, role, transformer_impl, ep_rank=ep_rank)
        specs.extend(_rank_specs(params, layout, dims, pp_stage, vpp_chunk, [tp_rank], [etp_rank]))
    return specs


def hf_tensor_shapes(hf_config_or_dir: PretrainedConfig | str, role: str = "actor") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the model's HF checkpoint, in model order."""
    config = load_hf_config(hf_config_or_dir)
    family = family_for(config)
    dims = family.read_dims(config)
    whole = ParallelLayout()
    shapes: dict[str, tuple[int, ...]] = {}
    for param in chunk_params(dims, family, whole, 0, 0, role):
        for tensor in param.mapping.tensors():
            shapes.setdefault(tensor.name, tensor.shape)
    return shapes
