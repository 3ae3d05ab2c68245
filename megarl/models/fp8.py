"""FP8 block-quantised HF checkpoints (DeepSeek-V3's official format), dequantised as they are read.

A quantised linear weight ``W`` [rows, cols] is stored as ``float8_e4m3fn`` next to
``<name>_scale_inv`` (fp32; float8_e8m0fnu with ``scale_fmt: ue8m0``) of shape
[ceil(rows / 128), ceil(cols / 128)], one scale per 128 x 128 block; the last block row and
column may be ragged (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows: 4 full blocks and 64).
Dequantised: ``W[i, j] = float(W_fp8[i, j]) * scale_inv[i // 128, j // 128]``, in fp32.
Other tensors (embeddings, norms, the router, ``modules_to_not_convert``) are stored unquantised
and pass through unchanged. config.json declares the format::

    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                            "fmt": "e4m3", "activation_scheme": "dynamic"}

Other block sizes and element formats are refused (``block_fp8``); so are quantisation methods other
than gpt-oss's MXFP4 experts, which ``megarl.models.mxfp4`` reads (``checkpoint_quantization``: either).
``Dequantizer`` is the hook the loader calls on every slice it reads: a rank reads only its own
rows or columns of the fp8 tensor and only the scale blocks that slice touches.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from megarl.models.mxfp4 import BLOCKS_SUFFIX, MXFP4, SCALES_SUFFIX, ExpertReader, mxfp4_experts

SCALE_SUFFIX = "_scale_inv"
BLOCK = (128, 128)
FP8_DTYPE = torch.float8_e4m3fn
# every 8-bit float torch knows: a weight stored in any of them must be dequantised or refused
FLOAT8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                         "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))
_SUPPORTED = ("quant_method 'fp8' with weight_block_size [128, 128], fmt 'e4m3' and activation_scheme "
              "'dynamic' (DeepSeek-V3's format)")
_MXFP4 = "quant_method 'mxfp4' for gpt-oss's experts (its published format)"


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's FP8 block quantisation: ``block`` = (rows, cols) per scale."""

    block: tuple[int, int] = BLOCK
    kind, served = "FP8 block-quantised", "FP8"  # for messages


def block_fp8(config) -> BlockFP8 | None:
    """The FP8 block quantisation declared in an HF config, None when unquantised or MXFP4 (``mxfp4_experts``
    checks that); raises a ValueError naming the field for any other quantisation."""
    declared = getattr(config, "quantization_config", None)
    if declared is None:
        return None
    settings = declared if isinstance(declared, dict) else declared.to_dict()

    def refuse(field: str, value) -> ValueError:
        return ValueError(
            f"quantization_config.{field}={value!r} is not supported: megarl reads unquantised checkpoints, FP8 "
            f"block-quantised ones ({_SUPPORTED}) and MXFP4 ones ({_MXFP4}), dequantising those as it loads; "
            "dequantise this checkpoint to "
            "bf16 first, or convert it with a tool for its format"
        )

    method = str(settings.get("quant_method", "")).lower()
    if method == "mxfp4":
        return None
    if method != "fp8":
        raise refuse("quant_method", settings.get("quant_method"))
    block = settings.get("weight_block_size")
    if block is None or [int(b) for b in block] != list(BLOCK):
        raise refuse("weight_block_size", block)  # None is per-tensor FP8: a different scale layout
    for field, allowed in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)), ("scale_fmt", ("float", "ue8m0"))):
        value = settings.get(field)
        if value is not None and str(value).lower() not in allowed:
            raise refuse(field, value)
    return BlockFP8(tuple(int(b) for b in block))


def checkpoint_quantization(config) -> BlockFP8 | MXFP4 | None:
    """The quantisation an HF config declares: FP8 blocks, gpt-oss's MXFP4 experts, or None when unquantised;
    raises a ValueError naming the field for any other."""
    return block_fp8(config) or mxfp4_experts(config)


def fp8_rollout_problem(key: str, model_path, quantization: BlockFP8 | MXFP4 = BlockFP8()) -> str:
    """Why a run cannot train from the quantised (FP8 or MXFP4) checkpoint at ``model_path`` (given as ``key``),
    and how to make one it can: the trainer dequantises it, but the vLLM fleet would serve it quantised while
    the weight sync sends it full-precision weights."""
    return (f"{key}={model_path} is {quantization.kind}: the trainer would dequantise it, but the vLLM fleet would "
            f"serve it in {quantization.served} while the weight sync sends it full-precision weights. Make a bf16 "
            "copy once and train "
            f"from that: python -m conversion hf-to-megatron --hf {model_path} --out MCORE --dtype bf16 (under "
            f"torchrun for a large model), then python -m conversion megatron-to-hf --checkpoint MCORE --hf-config "
            f"{model_path} --out BF16_DIR, and set {key}=BF16_DIR (actor_rollout_ref.actor.megatron."
            "dist_checkpointing_path=MCORE starts the trainer from the conversion)")


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def covering_blocks(hf_slice: tuple[slice, ...], block: tuple[int, int]) -> tuple[slice, slice]:
    """The scale rows and columns whose blocks the 2-D slice ``hf_slice`` touches."""
    (rows, cols), (block_rows, block_cols) = hf_slice, block
    return (slice(rows.start // block_rows, -(-rows.stop // block_rows)),
            slice(cols.start // block_cols, -(-cols.stop // block_cols)))


def dequantize(values: torch.Tensor, scales: torch.Tensor, hf_slice: tuple[slice, ...],
               block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``values * scale`` for the slice ``hf_slice`` of a block-quantised weight, given the
    scale blocks ``covering_blocks(hf_slice)`` (``scales``)."""
    (rows, cols), (block_rows, block_cols) = hf_slice, block
    row_block = torch.arange(rows.start, rows.stop) // block_rows - rows.start // block_rows
    col_block = torch.arange(cols.start, cols.stop) // block_cols - cols.start // block_cols
    out = values.to(torch.float32)
    return out.mul_(scales.to(torch.float32)[row_block][:, col_block])


class Dequantizer:
    """The loader's hook: ``dequantizer(name, hf_slice, values)`` returns ``values`` unchanged for an
    unquantised tensor and the fp32 dequantised slice for an FP8 one, reading the scale blocks it
    needs from the checkpoint (each file it opens stays mapped until the dequantizer is dropped)."""

    def __init__(self, model_dir: str | os.PathLike, files: dict[str, str], quantization: BlockFP8 | None):
        self.model_dir, self.files, self.quantization = Path(model_dir), files, quantization
        self._open: dict[str, object] = {}

    def __call__(self, name: str, hf_slice: tuple[slice, ...], values: torch.Tensor) -> torch.Tensor:
        if values.dtype not in FLOAT8_DTYPES:
            return values
        if self.quantization is None or values.dtype != FP8_DTYPE:
            declared = "declares no quantization_config" if self.quantization is None else "declares fmt e4m3"
            raise ValueError(
                f"{name} is stored as {values.dtype} but {self.model_dir / 'config.json'} {declared}; megarl reads "
                f"FP8 checkpoints that declare {_SUPPORTED} and store float8_e4m3fn weights"
            )
        if len(hf_slice) != 2:
            raise ValueError(f"{name}: FP8 block quantisation covers 2-D weights, this tensor has {len(hf_slice)} dims")
        scale = scale_name(name)
        if scale not in self.files:
            raise KeyError(f"{name} is stored as {values.dtype} but the checkpoint at {self.model_dir} has no {scale}")
        handle = self._file(self.files[scale])
        expected = tuple(-(-n // b) for n, b in zip(self._shape(name), self.quantization.block))
        stored = tuple(handle.get_slice(scale).get_shape())
        if stored != expected:
            raise ValueError(f"{scale} has shape {stored}; {self._shape(name)} in "
                             f"{self.quantization.block[0]}x{self.quantization.block[1]} blocks needs {expected}")
        blocks = handle.get_slice(scale)[covering_blocks(hf_slice, self.quantization.block)]
        return dequantize(values, blocks, hf_slice, self.quantization.block)

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.files[name]).get_slice(name).get_shape())

    def _file(self, file_name: str):
        if file_name not in self._open:
            self._open[file_name] = safe_open(str(self.model_dir / file_name), framework="pt")
        return self._open[file_name]


def dequantized_tensors(model_dir: str | os.PathLike, wanted=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of a checkpoint in full (those whose name ``wanted(name)`` accepts, when given), FP8 ones and
    MXFP4 experts dequantised to fp32 and their scales left out (``conversion verify`` builds its transformers
    reference from these; the export copies the tensors the bridge skips with them)."""
    from megarl.models.dims import load_hf_config
    from megarl.models.loading import checkpoint_files

    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    config = load_hf_config(model_dir)
    quantization = block_fp8(config)
    scales = {scale_name(name) for name in files} if quantization is not None else set()
    dequantizer = Dequantizer(model_dir, files, quantization)
    experts = ExpertReader(model_dir, files, mxfp4_experts(config))
    for file_name in sorted(set(files.values())):
        with safe_open(str(model_dir / file_name), framework="pt") as f:
            for name in f.keys():
                packed = name.removesuffix(BLOCKS_SUFFIX)
                if wanted is not None and not wanted(packed):
                    continue
                if name.endswith(BLOCKS_SUFFIX) and experts.stores(packed):
                    yield packed, experts.full(packed, experts.shape(packed))
                elif name.endswith(SCALES_SUFFIX) and name.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX in files:
                    continue
                elif name not in scales:
                    full = tuple(slice(0, n) for n in f.get_slice(name).get_shape())
                    yield name, dequantizer(name, full, f.get_tensor(name))
