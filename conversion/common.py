"""What the three conversion commands share: layout flags, world-size checks, input checks,
atomic output directories and rank-0 progress lines.

Process count: megatron-core places every rank on a TP x PP grid of dense weights (data
parallelism takes the rest of the world) and carves the expert-parallel groups (EP x expert-TP)
out of the TP x DP ranks of each stage. A conversion uses one model replica, so it needs
``pp * lcm(tp, ep * etp)`` processes: ``tp * pp`` for a dense model or whenever ``ep * etp``
divides ``tp``.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from megarl.models import ParallelLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ConversionError(Exception):
    """A problem with the user's input or flags; the CLI prints the message and exits 2."""


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("megatron layout (processes: pp * lcm(tp, ep * etp))")
    group.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    group.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    group.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE only)")
    group.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (MoE only)")
    group.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage (needs pp >= 2)")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="pad the vocabulary to a multiple of this x tp (megatron's rule; the padding is never exported)")


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    try:
        return ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp,
                              make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc


def describe(layout: ParallelLayout) -> str:
    return f"tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.etp} vpp={layout.vpp}"


def required_world_size(layout: ParallelLayout) -> int:
    """Processes for one model replica: TP x PP ranks, widened so EP x expert-TP fits in TP x DP."""
    return layout.pp * math.lcm(layout.tp, layout.ep * layout.etp)


def check_world_size(layout: ParallelLayout, command: str, argv: list[str]) -> None:
    """Raise with the exact torchrun command when this process count does not fit the layout."""
    needed = required_world_size(layout)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != needed:
        line = f"torchrun --standalone --nproc-per-node {needed} -m conversion {command} {shlex.join(argv)}"
        raise ConversionError(
            f"layout tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.etp} needs {needed} process(es), "
            f"this run has {world}; run:\n  {line}"
        )


def start_model_parallel(layout: ParallelLayout) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU) and megatron's parallel state for ``layout``."""
    from megarl import platform

    platform.init_distributed()
    platform.initialize_model_parallel(
        tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, vpp=layout.vpp if layout.vpp > 1 else None
    )


def stop_model_parallel() -> None:
    from megarl import platform

    platform.destroy()


def is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


class Progress:
    """Numbered progress lines with elapsed time, printed by rank 0 only."""

    def __init__(self, steps: int) -> None:
        self.steps, self.done, self.started = steps, 0, time.perf_counter()

    def step(self, message: str) -> None:
        self.done += 1
        if is_rank0():
            print(f"[{self.done}/{self.steps}] {message} (t={time.perf_counter() - self.started:.1f}s)", flush=True)


def check_hf_dir(path: str | os.PathLike, need_weights: bool, layout: ParallelLayout | None = None) -> Path:
    """An HF model directory with config.json (and readable safetensors when ``need_weights``)
    whose model ``layout`` can split (checked before any process group starts)."""
    from megarl.models import check_layout, load_hf_config, model_dims
    from megarl.models.fp8 import checkpoint_quantization

    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"HF model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ConversionError(f"{path} has no config.json; pass a Hugging Face model directory")
    try:
        config = load_hf_config(path)
        dims = model_dims(config)
        checkpoint_quantization(config)  # FP8 blocks and MXFP4 experts are dequantised on the way in; others are refused
        if layout is not None:
            check_layout(dims, layout)
    except ValueError as exc:
        raise ConversionError(f"{path}: {exc}") from exc
    if need_weights:
        check_safetensors(path)
    return path


def check_safetensors(path: Path) -> None:
    """Every safetensors file of ``path`` is present, complete (as long as its header says) and readable."""
    import json

    from safetensors import safe_open

    from megarl.models.loading import INDEX_FILE, SINGLE_FILE

    if (path / INDEX_FILE).is_file():
        files = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    elif (path / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise ConversionError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}; pass an HF safetensors checkpoint")
    for name in files:
        file = path / name
        if not file.is_file():
            raise ConversionError(f"{file} is named in {INDEX_FILE} but does not exist")
        try:
            expected = _safetensors_data_end(file)
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:  # a damaged header: struct, json or safetensors errors
            size = file.stat().st_size
            raise ConversionError(
                f"{file} is truncated or corrupt ({size} bytes; {exc}); re-download or re-export it"
            ) from exc
        if file.stat().st_size < expected:
            raise ConversionError(
                f"{file} is truncated: {file.stat().st_size} bytes, its header describes {expected}; re-download or re-export it"
            )


def _safetensors_data_end(file: Path) -> int:
    """The file size the header promises: 8 + header length + end of the last tensor's data."""
    import json
    import struct

    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    return 8 + header_len + max(ends, default=0)


def prepare_output(out: str | os.PathLike, overwrite: bool) -> tuple[Path, Path]:
    """(final, staging) paths; refuses an existing non-empty output unless ``overwrite``.

    Everything is written under ``<out>.tmp``; ``finish_output`` renames it to ``<out>`` once
    complete, so an interrupted run leaves only the ``.tmp`` directory, never a valid-looking output.
    """
    final = Path(out)
    if final.exists() and (not final.is_dir() or any(final.iterdir())) and not overwrite:
        raise ConversionError(f"output {final} already exists and is not empty; pass --overwrite to replace it")
    return final, final.with_name(final.name + ".tmp")


def finish_output(staging: Path, final: Path) -> None:
    """Replace ``final`` by the completed ``staging`` directory (rank 0)."""
    if final.exists():
        shutil.rmtree(final) if final.is_dir() else final.unlink()
    os.rename(staging, final)


@contextmanager
def clean_up_on_failure(staging: Path):
    """Remove the partly written ``staging`` directory (rank 0) when the body raises."""
    try:
        yield
    except BaseException:
        if is_rank0():
            shutil.rmtree(staging, ignore_errors=True)
        raise


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
