"""Export megatron shards back to HF names: per-rank pieces (weight sync) or full tensors (conversion).

``export_hf_pieces`` yields, on each rank, (hf_name, hf_slice, tensor) pieces straight from its own
shards (views, no copy, no communication). A LoRA-adapted linear exports its merged weight
``W + alpha/r * B A`` (``megarl.models.lora.merge``: computed in fp32 when a region is read, then
cast), so the weight sync and the HF export carry the adapted model without knowing about LoRA. By default only the sending copy of each element is
yielded: primary specs (TP rank 0 for TP-replicated params) on data-parallel rank 0 for dense
params (counting context-parallel ranks, which hold replicas too) and expert-data-parallel rank 0
for expert params, so over all ranks each HF element is yielded exactly once.

``gather_hf_tensors`` assembles full HF tensors on one rank, one tensor at a time (owners send
their pieces point-to-point), and ``save_hf_checkpoint`` writes them as safetensors files of
bounded size: the writing rank never holds more than one file's worth of tensors.
"""
from __future__ import annotations

import copy
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import PretrainedConfig

from megarl.models.dims import load_hf_config
from megarl.models.families import family_for
from megarl.models.fp8 import checkpoint_quantization
from megarl.models.layout import ParallelLayout
from megarl.models.loading import INDEX_FILE, SINGLE_FILE, chunk_parameters, this_rank_shards
from megarl.models.packed import pack_stream
from megarl.models.shards import ShardSpec, hf_tensor_shapes, param_shards


@dataclass(frozen=True)
class ExportedPiece:
    """``hf_tensor[hf_slice] == tensor`` for the HF tensor ``hf_name`` of shape ``hf_shape``."""

    hf_name: str
    hf_shape: tuple[int, ...]
    hf_slice: tuple[slice, ...]
    tensor: torch.Tensor


# Files an HF export copies from the source checkpoint besides config.json (written from the loaded config).
TOKENIZER_PATTERNS = (
    "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "vocab*", "merges.txt", "chat_template*", "preprocessor_config.json",
)


def copy_tokenizer_files(hf_dir: Path, out: Path) -> list[str]:
    """Copy the tokenizer, chat template and generation config of ``hf_dir`` into ``out``; their names."""
    import shutil

    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for source in sorted(Path(hf_dir).glob(pattern)):
            if source.is_file():
                shutil.copy2(source, Path(out) / source.name)
                copied.append(source.name)
    return copied


def _is_sender(spec: ShardSpec) -> bool:
    """Whether this rank's copy of ``spec`` is the one that sends (see module docstring)."""
    from megatron.core import parallel_state as ps

    if not spec.primary:
        return False
    if spec.is_expert:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0  # CP ranks hold replicas too


def export_hf_pieces(
    models: list,
    hf_config,
    layout: ParallelLayout,
    role: str = "actor",
    transformer_impl: str = "local",
    replicas: bool = False,
) -> Iterator[ExportedPiece]:
    """This rank's pieces of HF tensors; ``replicas=True`` also yields the copies it holds that do not send."""
    from megarl.models.lora import region

    specs = this_rank_shards(load_hf_config(hf_config), layout, role, transformer_impl)
    for spec, param in export_pairs(models, specs):
        if replicas or _is_sender(spec):
            for piece in spec.pieces:
                yield ExportedPiece(piece.hf_name, piece.hf_shape, piece.hf_slice, region(param, piece.megatron_slice))


def export_pairs(models: list, specs: list[ShardSpec]) -> list:
    """``chunk_parameters`` as the export reads them: an adapted linear's weight is its merged weight."""
    from megarl.models.lora import exported_tensor
    from megarl.models.loading import unwrap

    return [(spec, exported_tensor(unwrap(models[spec.vpp_chunk]), spec.name, tensor))
            for spec, tensor in chunk_parameters(models, specs)]


def _rank_coords() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "pp": ps.get_pipeline_model_parallel_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }


def _sources(specs: list[ShardSpec]) -> dict[str, list]:
    """HF name -> [(source global rank, spec, piece)] over all primary specs, via every rank's coordinates."""
    coords: list[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(coords, _rank_coords())
    dense = {(c["pp"], c["tp"]): rank for rank, c in enumerate(coords) if c["dp"] == 0}
    expert = {(c["pp"], c["ep"], c["etp"]): rank for rank, c in enumerate(coords) if c["edp"] == 0}
    sources = defaultdict(list)
    for spec in specs:
        if not spec.primary:
            continue
        rank = expert[(spec.pp_stage, spec.ep_rank, spec.etp_rank)] if spec.is_expert else dense[(spec.pp_stage, spec.tp_rank)]
        for piece in spec.pieces:
            sources[piece.hf_name].append((rank, spec, piece))
    return sources


@torch.no_grad()
def gather_hf_tensors(
    models: list,
    hf_config,
    layout: ParallelLayout,
    role: str = "actor",
    transformer_impl: str = "local",
    dst: int = 0,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors, in checkpoint order, yielded on rank ``dst`` (CPU tensors).

    Every rank must call this and exhaust the iterator (the other ranks yield nothing but send
    their pieces as the iteration reaches them). ``dtype`` casts the parameters; buffers (the
    router's expert bias) stay fp32, as megatron and HF keep them. Vocabulary padding is not part
    of any piece, so it never leaves the model.
    """
    config = load_hf_config(hf_config)
    pairs = export_pairs(models, this_rank_shards(config, layout, role, transformer_impl))
    local = {(spec.vpp_chunk, spec.name): tensor for spec, tensor in pairs}
    param_dtype = next(tensor.dtype for spec, tensor in pairs if not spec.buffer)
    sources = _sources(param_shards(config, layout, role, transformer_impl))
    gathered = gather_pieces(hf_tensor_shapes(config, role), sources, local, dst,
                             lambda spec: torch.float32 if spec.buffer else param_dtype)
    cast = ((name, full if dtype is None or sources[name][0][1].buffer else full.to(dtype)) for name, full in gathered)
    family = family_for(config)
    yield from pack_stream(family, family.read_dims(config), cast)  # a family's packed tensors, as in its checkpoints


def gather_pieces(shapes: dict[str, tuple[int, ...]], sources: dict[str, list], local: dict, dst: int,
                  comm_dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Assemble each tensor of ``shapes`` on rank ``dst`` from its ``sources`` (``_sources``), one at a
    time; ``local[(vpp_chunk, name)]`` is this rank's tensor of a spec, ``comm_dtype(spec)`` the dtype
    on the wire. Collective: every rank iterates to the end."""
    from megarl.platform import device

    rank = dist.get_rank()
    for name, shape in shapes.items():
        dtype = comm_dtype(sources[name][0][1])
        full = torch.empty(shape, dtype=dtype) if rank == dst else None
        for src, spec, piece in sources[name]:
            if src == rank:
                values = local[(spec.vpp_chunk, spec.name)][piece.megatron_slice]
                if rank == dst:
                    full[piece.hf_slice] = values.cpu()
                else:
                    dist.send(values.to(dtype).contiguous(), dst)
            elif rank == dst:
                buffer = torch.empty([s.stop - s.start for s in piece.hf_slice], dtype=dtype, device=device())
                dist.recv(buffer, src)
                full[piece.hf_slice] = buffer.cpu()
        if rank == dst:
            yield name, full


def _export_config(hf_config, role: str):
    """The config.json to write: a critic becomes ``<Family>ForTokenClassification`` with one label;
    an FP8 block-quantised or MXFP4 source loses its ``quantization_config`` (the weights were dequantised);
    the fields vLLM needs that transformers drops (``FamilySpec.vllm_hf_overrides``) are kept."""
    config = copy.deepcopy(hf_config)
    if checkpoint_quantization(config) is not None:
        del config.quantization_config
    family = family_for(config)
    for key, value in family.vllm_hf_overrides.items():
        sub_config = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(sub_config, PretrainedConfig):  # a field of text_config, as vLLM merges it
            for field, field_value in value.items():
                setattr(sub_config, field, field_value)
        else:
            setattr(config, key, value)
    if role == "critic":
        causal_lm = family.architectures[0]
        config.architectures = [causal_lm.replace("ForCausalLM", "ForTokenClassification")]
        config.num_labels = 1
    return config


def save_hf_checkpoint(
    models: list,
    hf_config_or_dir,
    layout: ParallelLayout,
    out_dir: str | os.PathLike,
    role: str = "actor",
    transformer_impl: str = "local",
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
    dst: int = 0,
    source_dir: str | os.PathLike | None = None,
) -> Path:
    """Write the model as an HF safetensors checkpoint (+ config.json) from rank ``dst``; call on every rank.

    ``source_dir``: the HF checkpoint the model was built from. The tensors its family skips (the MTP layers,
    which megarl neither trains nor serves) are copied from it unchanged (FP8 ones dequantised, in the export's
    dtype), so the export is the whole checkpoint its config.json describes."""
    config = load_hf_config(hf_config_or_dir)
    out_dir = Path(out_dir)
    rank = dist.get_rank()
    files: list[tuple[str, list[str], int]] = []  # (temporary file name, tensor names, tensor bytes)
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        name = f"part-{len(files):05d}.safetensors.tmp"
        save_file(pending, str(out_dir / name), metadata={"format": "pt"})
        files.append((name, list(pending), pending_bytes))
        pending, pending_bytes = {}, 0

    def add(name: str, tensor: torch.Tensor) -> None:
        nonlocal pending_bytes
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor
        pending_bytes += size

    if rank == dst:
        out_dir.mkdir(parents=True, exist_ok=True)
    written = dtype
    for name, tensor in gather_hf_tensors(models, config, layout, role, transformer_impl, dst, dtype):
        written = written or (tensor.dtype if tensor.is_floating_point() else None)
        add(name, tensor)
    if rank == dst and source_dir is not None and role == "actor":
        from megarl.models.loading import skipped_tensors

        for name, tensor, dequantised in skipped_tensors(source_dir):
            add(name, tensor.to(written) if (dtype is not None or dequantised) and tensor.is_floating_point() else tensor)
    if rank == dst:
        if pending:
            flush()
        _finish(out_dir, files)
        _export_config(config, role).save_pretrained(str(out_dir))
    dist.barrier()
    return out_dir


def _finish(out_dir: Path, files: list[tuple[str, list[str], int]]) -> None:
    """Give the written files their HF names and write the index when there are several."""
    if len(files) == 1:
        os.replace(out_dir / files[0][0], out_dir / SINGLE_FILE)
        return
    weight_map, total = {}, 0
    for i, (tmp_name, names, size) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(out_dir / tmp_name, out_dir / final)
        total += size
        weight_map.update({name: final for name in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
