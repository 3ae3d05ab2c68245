"""Load HF safetensors into this rank's megatron shards, reading only what the rank holds.

Each rank asks the shard layout for its own specs, finds the files holding those HF tensors
(``model.safetensors.index.json``), opens only those files, and reads only its rows/columns with
``safe_open(...).get_slice(name)[hf_slice]``. No rank reads another stage's layers, another EP
rank's experts, or the other TP ranks' rows, so no rank ever holds the whole model. FP8
block-quantised checkpoints are dequantised slice by slice as they are read (``models/fp8.py``),
gpt-oss's MXFP4 experts one expert at a time (``models/mxfp4.py``).
"""
from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from megarl.models.dims import load_hf_config
from megarl.models.fp8 import Dequantizer, block_fp8
from megarl.models.families import family_for
from megarl.models.grouped_experts import bridge_tensors
from megarl.models.layout import ParallelLayout
from megarl.models.mxfp4 import ExpertReader, mxfp4_experts
from megarl.models.packed import packed_parts, read_piece
from megarl.models.shards import HF_VALUE_BIAS, HF_VALUE_WEIGHT, ShardSpec, rank_shards

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class LoadReport:
    """What a rank read: files opened, elements read, HF tensors absent and left as initialised."""

    files: list[str] = field(default_factory=list)
    elements_read: int = 0
    left_initialised: list[str] = field(default_factory=list)


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def checkpoint_files(model_dir: str | os.PathLike) -> dict[str, str]:
    """HF tensor name -> safetensors file name, from the index (or the single file's header)."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        return dict(json.loads((model_dir / INDEX_FILE).read_text())["weight_map"])
    if (model_dir / SINGLE_FILE).is_file():
        with safe_open(str(model_dir / SINGLE_FILE), framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"{model_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}; pass an HF safetensors checkpoint")


def this_rank_shards(hf_config, layout: ParallelLayout, role: str, transformer_impl: str) -> list[ShardSpec]:
    """``rank_shards`` for the calling rank, its coordinates taken from megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return rank_shards(
        hf_config,
        layout,
        pp_stage=ps.get_pipeline_model_parallel_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank() if layout.ep > 1 else 0,
        etp_rank=ps.get_expert_tensor_parallel_rank() if layout.etp > 1 else 0,
        role=role,
        transformer_impl=transformer_impl,
    )


def chunk_parameters(models: list, specs: list[ShardSpec]) -> list[tuple[ShardSpec, torch.Tensor]]:
    """Pair every spec with its parameter (or buffer); raise if the models and the layout disagree on any name.

    Grouped-GEMM experts are paired by their per-expert views (``megarl.models.grouped_experts``).

    Adapter tensors a model transform added (LoRA's ``lora_A`` / ``lora_B``) are not part of the
    bridge's layout and are left out here.
    """
    from megarl.models.lora import is_adapter_param

    pairs = []
    for chunk, model in enumerate(models):
        module = unwrap(model)
        params = {name: p for name, p in bridge_tensors(module).items() if not is_adapter_param(name)}
        chunk_specs = {spec.name: spec for spec in specs if spec.vpp_chunk == chunk}
        expected = {name for name, spec in chunk_specs.items() if not spec.buffer}
        missing, extra = sorted(expected - set(params)), sorted(set(params) - expected)
        buffers = dict(module.named_buffers())
        missing += sorted(name for name, spec in chunk_specs.items() if spec.buffer and name not in buffers)
        if missing or extra:
            raise ValueError(
                f"model chunk {chunk} does not match the shard layout: tensors the layout expects but the model "
                f"lacks {missing[:5]}, params the layout does not know {extra[:5]}; build the model with the same "
                "layout, role and transformer_impl"
            )
        for name, spec in chunk_specs.items():
            tensor = buffers[name] if spec.buffer else params[name]
            if tuple(tensor.shape) != spec.local_shape:
                raise ValueError(f"{name}: model shape {tuple(tensor.shape)} != layout shape {spec.local_shape}")
            pairs.append((spec, tensor))
    return pairs


@torch.no_grad()
def zero_vocab_padding(models: list, hf_config, layout: ParallelLayout, role: str = "actor", transformer_impl: str = "local") -> None:
    """Zero the vocabulary padding rows of this rank's embedding and output layer."""
    for spec, tensor in chunk_parameters(models, this_rank_shards(hf_config, layout, role, transformer_impl)):
        if spec.padding is not None:
            tensor.data[spec.padding].zero_()


_logged_skips: set[str] = set()


def skipped_tensors_note(hf_config, names, where: str) -> str | None:
    """One line naming the checkpoint tensors the family leaves out on purpose (DeepSeek-V3's
    multi-token-prediction layers), or None when the checkpoint holds none."""
    pattern = family_for(hf_config).skipped_hf_tensors(hf_config)
    skipped = sorted(name for name in names if pattern is not None and pattern.search(name))
    if not skipped:
        return None
    prefixes = sorted({pattern.search(name).group(0) for name in skipped})
    return (f"{hf_config.model_type}: skipping {len(skipped)} tensors of {where} under "
            f"{', '.join(p + '*' for p in prefixes)} (multi-token prediction, num_nextn_predict_layers="
            f"{getattr(hf_config, 'num_nextn_predict_layers', '?')}): megarl trains and serves the main model only; "
            "an export writes them as loaded")


def skipped_tensors(model_dir: str | os.PathLike):
    """``(name, tensor, dequantised)`` for the checkpoint's tensors that its family skips (``skipped_hf_tensors``:
    the MTP layers), as stored, FP8 ones dequantised to fp32: the export writes them unchanged, so it keeps the
    checkpoint whole."""
    from megarl.models.fp8 import dequantized_tensors, scale_name

    config = load_hf_config(model_dir)
    pattern = family_for(config).skipped_hf_tensors(config)
    if pattern is None:
        return
    try:
        files = checkpoint_files(model_dir)
    except FileNotFoundError:  # a config-only directory (a run started from a megatron checkpoint)
        logger.info("%s holds no weights: an export leaves out the tensors its family skips (%s)", model_dir,
                    pattern.pattern)
        return
    for name, tensor in dequantized_tensors(model_dir, wanted=lambda name: pattern.search(name) is not None):
        yield name, tensor, scale_name(name) in files


def describe_skipped(model_dir: str | os.PathLike) -> str | None:
    """``skipped_tensors_note`` for an HF checkpoint directory (reads the index or header only)."""
    return skipped_tensors_note(load_hf_config(model_dir), checkpoint_files(model_dir), str(model_dir))


def log_skipped_tensors(hf_config, names, where: str) -> None:
    """Log ``skipped_tensors_note`` once per checkpoint and process, on rank 0."""
    import torch.distributed as dist

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and where not in _logged_skips:
        note = skipped_tensors_note(hf_config, names, where)
        if note:
            _logged_skips.add(where)
            logger.info(note)


@torch.no_grad()
def load_hf_weights(
    models: list,
    model_dir: str | os.PathLike,
    layout: ParallelLayout,
    role: str = "actor",
    transformer_impl: str = "local",
) -> LoadReport:
    """Fill this rank's model chunks from the HF checkpoint in ``model_dir``; returns what was read.

    Every parameter must be found in the checkpoint, except a critic's value head (``score.*``)
    when loading a causal-LM checkpoint: it keeps its initialisation.
    """
    model_dir = Path(model_dir)
    hf_config = load_hf_config(model_dir)
    pairs = chunk_parameters(models, this_rank_shards(hf_config, layout, role, transformer_impl))
    files = checkpoint_files(model_dir)
    dequantize = Dequantizer(model_dir, files, block_fp8(hf_config))  # refuses other quantisations
    mxfp4 = ExpertReader(model_dir, files, mxfp4_experts(hf_config))
    log_skipped_tensors(hf_config, files, str(model_dir))
    family = family_for(hf_config)
    packed = packed_parts(family, family.read_dims(hf_config))  # parts read from a row of a packed tensor
    report = LoadReport()
    by_file: dict[str, list] = defaultdict(list)
    for spec, param in pairs:
        if spec.padding is not None:
            param.data[spec.padding].zero_()
        for piece in spec.pieces:
            if piece.hf_name in files:
                by_file[files[piece.hf_name]].append((piece, param))
            elif piece.hf_name in packed and packed[piece.hf_name][0].name in files:
                by_file[files[packed[piece.hf_name][0].name]].append((piece, param))
            elif piece.hf_name in packed and mxfp4.stores(packed[piece.hf_name][0].name):
                by_file[mxfp4.file_of(packed[piece.hf_name][0].name)].append((piece, param))
            elif role == "critic" and piece.hf_name in (HF_VALUE_WEIGHT, HF_VALUE_BIAS):
                report.left_initialised.append(piece.hf_name)
            else:
                hint = ""
                if any(name.startswith("model.language_model.") for name in files):
                    hint = ("; it holds a language model under model.language_model.*: write it as a text checkpoint "
                            "with `python -m megarl.devtools.extract_language_model SRC OUT`")
                raise KeyError(f"{piece.hf_name} (for {spec.name}) is not in the checkpoint at {model_dir}{hint}")
    for file_name in sorted(by_file):
        report.files.append(file_name)
        with safe_open(str(model_dir / file_name), framework="pt") as f:
            for piece, param in by_file[file_name]:
                if piece.hf_name in packed:
                    quantized = packed[piece.hf_name][0].name not in files  # stored as MXFP4 blocks
                    values = read_piece(f, packed[piece.hf_name], piece.hf_slice, mxfp4.row if quantized else None)
                    param.data[piece.megatron_slice].copy_(dequantize(piece.hf_name, piece.hf_slice, values))
                    report.elements_read += values.numel()
                    continue
                shape = tuple(f.get_slice(piece.hf_name).get_shape())
                if shape != piece.hf_shape:
                    raise ValueError(f"{piece.hf_name}: checkpoint shape {shape} != config shape {piece.hf_shape}")
                values = f.get_slice(piece.hf_name)[piece.hf_slice]
                param.data[piece.megatron_slice].copy_(dequantize(piece.hf_name, piece.hf_slice, values))
                report.elements_read += values.numel()
    return report
