"""HF safetensors checkpoint -> megatron-core distributed checkpoint at a chosen TP/PP/EP/ETP/VPP.

    torchrun --nproc-per-node N -m conversion hf-to-megatron --hf DIR --out DIR [--tp 2 --pp 1 ...]

N = pp * lcm(tp, ep * etp) (tp * pp for dense models); at N = 1 plain ``python -m conversion``
works. Each rank builds its megatron model chunks and reads only its own slices of the HF tensors
(``megarl.models.build_model`` streams file by file), so no rank holds the whole model. The result
is written with the engine's ``save_checkpoint`` as ``<out>/step_0`` plus ``<out>/latest`` (model
only; ``extra`` records the HF config and source path), the format the trainer resumes from and
``megatron-to-hf`` reads back, under any layout. Writing goes to ``<out>.tmp``, renamed when done.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from conversion.common import (
    DTYPES,
    ConversionError,
    Progress,
    add_layout_args,
    describe,
    check_hf_dir,
    check_world_size,
    clean_up_on_failure,
    finish_output,
    is_rank0,
    layout_from_args,
    prepare_output,
    start_model_parallel,
    stop_model_parallel,
)

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory for the megatron checkpoint")
    add_layout_args(parser)
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="parameter dtype of the checkpoint (auto: the HF weights' dtype)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output")


def checkpoint_dtype(hf_dir: Path) -> torch.dtype:
    """The dtype of the HF embedding tensor (the checkpoint's storage dtype; ``<family prefix>embed_tokens``,
    e.g. Qwen3-VL's ``model.language_model.embed_tokens.weight``)."""
    from safetensors import safe_open

    from megarl.models import model_dims
    from megarl.models.loading import checkpoint_files

    files = checkpoint_files(hf_dir)
    name = f"{model_dims(hf_dir).hf_prefix}embed_tokens.weight"
    if name not in files:
        raise ConversionError(f"{hf_dir} has no {name}; is it a causal LM checkpoint of a supported family?")
    with safe_open(str(hf_dir / files[name]), framework="pt") as f:
        stored = f.get_slice(name).get_dtype()
    if stored not in SAFETENSORS_DTYPES:
        raise ConversionError(f"{name} is stored as {stored}; pass --dtype fp32|bf16|fp16")
    return SAFETENSORS_DTYPES[stored]


def run(args: argparse.Namespace, argv: list[str]) -> Path:
    """Convert (collective over all ranks); returns the output directory."""
    from megarl.engine import save_checkpoint
    from megarl.models import build_model, load_hf_config
    from megarl.models.loading import describe_skipped

    layout = layout_from_args(args)
    hf_dir = check_hf_dir(args.hf, need_weights=True, layout=layout)
    check_world_size(layout, "hf-to-megatron", argv)
    final, staging = prepare_output(args.out, args.overwrite)
    dtype = checkpoint_dtype(hf_dir) if args.dtype == "auto" else DTYPES[args.dtype]
    progress = Progress(3)
    start_model_parallel(layout)
    try:
        progress.step(f"process groups ready: {describe(layout)}, {dist.get_world_size()} rank(s)")
        with clean_up_on_failure(staging):
            models = build_model(hf_dir, layout, "actor", load_weights=True, params_dtype=dtype)
            params = sum(p.numel() for m in models for p in m.parameters())
            skipped = describe_skipped(hf_dir)  # e.g. DeepSeek-V3's MTP layers are not converted
            progress.step(f"loaded this rank's slices of {hf_dir} ({params:,} parameters on rank 0, {dtype})"
                          + (f"; {skipped}" if skipped else ""))
            config = load_hf_config(hf_dir)
            extra = {"hf_config": config.to_dict(), "source": str(hf_dir.resolve()), "converted_by": "conversion.hf_to_megatron"}
            save_checkpoint(staging, 0, models, extra=extra)
            if is_rank0():
                finish_output(staging, final)
            dist.barrier()
            progress.step(f"wrote {final}/step_0 (megatron dist checkpoint, loadable under any layout)")
    finally:
        stop_model_parallel()
    return final
