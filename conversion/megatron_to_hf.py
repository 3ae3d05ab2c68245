"""megatron-core distributed checkpoint (a training checkpoint or an ``hf-to-megatron`` output)
-> HF safetensors checkpoint loadable by transformers and vLLM.

    python -m conversion megatron-to-hf --checkpoint RUN/actor[/step_N] --hf-config HF_DIR --out DIR

The checkpoint may have been saved under any TP/PP/EP layout; it is loaded at ``--tp/--pp/...``
(default 1: one process, the whole model in memory; larger layouts split it over
``pp * lcm(tp, ep * etp)`` torchrun processes). ``--hf-config`` is the HF directory the model came
from: its config.json says how to build the model and name the tensors, and its tokenizer files
and generation_config.json are copied. Before loading, every model tensor's global shape is
checked against the checkpoint, so a wrong ``--hf-config`` is named rather than failing deep in
megatron. The checkpoint's files are checked against its manifest (sizes first, checksums as it
loads) and its pickles are read with only the classes their format needs: a damaged or crafted
checkpoint is refused naming the file. Tensors are gathered one at a time to rank 0 and written as
shards of at most ``--max-shard-size`` with ``model.safetensors.index.json``, under ``<out>.tmp``
renamed when done.

A LoRA checkpoint (a LoRA run's ``actor/step_N``: the adapters only, with the LoRA settings and the
base model recorded) is merged: the base is read from ``--hf-config`` (which then needs its
weights) or from the megatron checkpoint the run started from (recorded; ``--base`` overrides), the
adapters from the checkpoint, and the export is ``W + alpha/r * B A`` computed in fp32.
``--adapter-only`` writes the adapter in PEFT format instead (``adapter_config.json`` +
``adapter_model.safetensors``; no base weights are read).
"""
from __future__ import annotations

import argparse
import shutil
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
from megarl.models.export import copy_tokenizer_files

MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "visual.")  # visual.: a VL model's vision tower


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory (e.g. RUN/actor/step_100) or a root holding a 'latest' marker")
    parser.add_argument("--hf-config", required=True, help="the original HF model directory (config + tokenizer)")
    parser.add_argument("--out", required=True, help="output HF model directory")
    add_layout_args(parser)
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB, 5GB or bytes")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="dtype of the written tensors (auto: the checkpoint's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output")
    parser.add_argument("--adapter-only", action="store_true",
                        help="a LoRA checkpoint: write its adapter in PEFT format instead of the merged model")
    parser.add_argument("--base", default=None,
                        help="a LoRA checkpoint: the megatron checkpoint of its base model (default: the one it records)")


def parse_size(text: str) -> int:
    """'2GB' / '500MB' / '1.5GiB' / '123456' -> bytes."""
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    value = text.strip().lower()
    for unit, factor in units.items():
        if value.endswith(unit):
            value, scale = value[: -len(unit)], factor
            break
    else:
        scale = 1
    try:
        size = int(float(value) * scale)
    except ValueError:
        raise ConversionError(f"--max-shard-size {text!r} is not a size; use e.g. 500MB, 2GB or a byte count") from None
    if size <= 0:
        raise ConversionError(f"--max-shard-size {text!r} must be positive")
    return size


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory: ``path`` itself, or the one its ``latest`` marker names."""
    from megarl.engine.checkpoint import LATEST_FILE, META_FILE, latest_checkpoint
    from megarl.engine.manifest import size_problems

    path = Path(path)
    if not path.exists():
        raise ConversionError(f"checkpoint {path} does not exist")
    if (path / LATEST_FILE).is_file():
        try:
            path = latest_checkpoint(path)
        except FileNotFoundError as exc:
            raise ConversionError(str(exc)) from exc
    if not (path / META_FILE).is_file():
        hint = " (a '.tmp' directory is an interrupted save)" if path.name.endswith(".tmp") else ""
        raise ConversionError(
            f"{path} is not a complete megarl checkpoint: no {META_FILE}{hint}; pass RUN/actor/step_N or RUN/actor"
        )
    damaged = size_problems(path)  # a stat per file; the checksums are read when the checkpoint loads
    if damaged:
        raise ConversionError(f"checkpoint {path} is damaged: {'; '.join(damaged)}; pass an older step_N")
    return path


def stored_tensors(checkpoint: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Model tensor key -> (global shape, dtype), from the checkpoint's metadata (no tensor data read;
    ``.metadata`` is checked against the manifest and unpickled with only the classes its format needs)."""
    from megarl.engine.checkpoint import checkpoint_tensors

    metadata = checkpoint_tensors(checkpoint)
    return {
        key: (tuple(tensor.global_shape), tensor.dtype)
        for key, tensor in metadata.items()
        if key.startswith(MODEL_KEY_PREFIXES)
    }


def expected_tensors(models: list, part: str = "all") -> dict[str, tuple[int, ...]]:
    """Model tensor key -> global shape, as the freshly built models would load them (``part``: all,
    or the ``trainable`` tensors a LoRA checkpoint holds). The first dimension of a tensor megatron
    lets load at another shape (the padded vocabulary of the embedding and output layer,
    ``allow_shape_mismatch``) is None: any padding loads."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from megarl.engine.checkpoint import model_sharded_state

    shapes: dict[str, tuple[int, ...]] = {}
    pending = [value for model in models for value in nested_values(model_sharded_state(model, part))]
    while pending:
        value = pending.pop()
        if isinstance(value, ShardedTensorFactory):
            pending.extend(nested_values(value.build()))
        elif isinstance(value, ShardedTensor):
            shape = tuple(value.global_shape)
            shapes[value.key] = (None, *shape[1:]) if value.allow_shape_mismatch else shape
    return shapes


def check_matches(models: list, stored: dict, checkpoint: Path, hf_config: Path, part: str = "all") -> None:
    """Raise naming the first tensors whose presence or shape differs between checkpoint and config."""
    expected = expected_tensors(models, part)
    missing = sorted(set(expected) - set(stored))
    def differs(stored_shape, expected_shape) -> bool:
        return len(stored_shape) != len(expected_shape) or any(
            e is not None and s != e for s, e in zip(stored_shape, expected_shape))

    wrong = sorted(f"{k}: checkpoint {stored[k][0]} vs config {expected[k]}" for k in expected
                   if k in stored and differs(stored[k][0], expected[k]))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config needs are not in the checkpoint, e.g. {missing[:3]}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) have other shapes, e.g. {wrong[:3]}")
    if problems:
        raise ConversionError(
            f"checkpoint {checkpoint} does not match --hf-config {hf_config}: " + "; ".join(problems)
            + ". Pass the HF directory of the model this checkpoint was trained from."
        )


def checkpoint_dtype(stored: dict, checkpoint: Path) -> torch.dtype:
    for key, (_, dtype) in stored.items():
        if key.startswith("embedding.") or key.startswith("decoder."):
            return dtype
    raise ConversionError(f"{checkpoint} holds no model tensors; is it a megarl model checkpoint?")


def lora_of(checkpoint: Path):
    """(LoRASettings, recorded base) of a LoRA checkpoint, or (None, None)."""
    from megarl.engine.checkpoint import checkpoint_meta
    from megarl.models.lora import LoRASettings

    meta = checkpoint_meta(checkpoint)
    if meta.get("model_part") != "trainable":
        return None, None
    if not meta.get("lora"):
        raise ConversionError(f"{checkpoint} holds only trained tensors but records no LoRA settings; it cannot be "
                              "merged into a base model")
    return LoRASettings.from_dict(meta["lora"]), meta.get("base") or {}


def lora_base(args: argparse.Namespace, base: dict) -> Path | None:
    """The megatron checkpoint to read a LoRA checkpoint's base from (None: the HF weights of --hf-config)."""
    path = args.base or base.get("megatron")
    if path is None:
        return None
    try:
        return resolve_checkpoint(path)
    except ConversionError as exc:
        raise ConversionError(f"the LoRA checkpoint's base model: {exc}; pass --base MEGATRON_CHECKPOINT") from None


def run(args: argparse.Namespace, argv: list[str]) -> Path:
    """Convert (collective over all ranks); returns the output directory."""
    from megarl.engine import load_checkpoint
    from megarl.models import build_model, default_transformer_impl, save_hf_checkpoint
    from megarl.models.lora import LoRATransform
    from megarl.models.lora.peft import save_peft_adapter

    layout = layout_from_args(args)
    checkpoint = resolve_checkpoint(args.checkpoint)
    lora, base = lora_of(checkpoint)
    if args.adapter_only and lora is None:
        raise ConversionError(f"--adapter-only: {checkpoint} is not a LoRA checkpoint (it holds the whole model)")
    base_checkpoint = lora_base(args, base) if lora is not None and not args.adapter_only else None
    from_hf = lora is not None and not args.adapter_only and base_checkpoint is None
    hf_config = check_hf_dir(args.hf_config, need_weights=from_hf, layout=layout)
    check_world_size(layout, "megatron-to-hf", argv)
    final, staging = prepare_output(args.out, args.overwrite)
    max_shard_bytes = parse_size(args.max_shard_size)
    stored = stored_tensors(checkpoint)
    params_dtype = checkpoint_dtype(stored, checkpoint)
    out_dtype = params_dtype if args.dtype == "auto" else DTYPES[args.dtype]
    progress = Progress(4)
    start_model_parallel(layout)
    try:
        what = f"LoRA adapters (rank {lora.rank}, alpha {lora.alpha:g}) of " if lora is not None else ""
        progress.step(f"reading {what}{checkpoint} at {describe(layout)} on {dist.get_world_size()} rank(s)")
        transforms = [LoRATransform(lora)] if lora is not None else []
        models = build_model(hf_config, layout, "actor", load_weights=from_hf, params_dtype=params_dtype,
                             transforms=transforms)
        check_matches(models, stored, checkpoint, hf_config, "trainable" if lora is not None else "all")
        if base_checkpoint is not None:
            load_checkpoint(base_checkpoint, models, load_rng=False)  # the base part of a whole-model checkpoint
        load_checkpoint(checkpoint, models, load_rng=False)
        base_note = "" if lora is None or args.adapter_only else \
            f", base from {base_checkpoint or hf_config}"
        progress.step(f"loaded the model state ({params_dtype}{base_note})")
        with clean_up_on_failure(staging):
            if is_rank0():
                shutil.rmtree(staging, ignore_errors=True)  # an interrupted earlier run
            dist.barrier()
            if args.adapter_only:
                save_peft_adapter(models, hf_config, layout, lora, staging, transformer_impl=default_transformer_impl())
                progress.step("gathered and wrote the adapter in PEFT format")
                if is_rank0():
                    finish_output(staging, final)
                dist.barrier()
                progress.step(f"wrote {final}")
                return final
            save_hf_checkpoint(models, hf_config, layout, staging, "actor", default_transformer_impl(),
                               max_shard_bytes=max_shard_bytes, dtype=out_dtype, source_dir=hf_config)
            merged = " (LoRA merged: W + alpha/r * B A in fp32)" if lora is not None else ""
            progress.step(f"gathered and wrote safetensors ({out_dtype}, shards <= {max_shard_bytes:,} bytes){merged}")
            if is_rank0():
                copied = copy_tokenizer_files(hf_config, staging)
                finish_output(staging, final)
                print(f"copied {', '.join(copied) or 'no tokenizer files'} from {hf_config}", flush=True)
            dist.barrier()
            progress.step(f"wrote {final}")
    finally:
        stop_model_parallel()
    return final

