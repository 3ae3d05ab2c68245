"""MXFP4 expert weights (gpt-oss's published format), dequantised as they are read.

MXFP4 (OCP microscaling FP4) stores a weight in blocks of 32 consecutive elements along its input
dimension, each element a 4-bit float and each block one shared power-of-two scale. The published
gpt-oss checkpoints store each MoE layer's experts this way; their bf16 tensors would be
``mlp.experts.gate_up_proj`` [experts, hidden, 2 * ffn] and ``mlp.experts.down_proj`` [experts, ffn,
hidden], i.e. [experts, in, out] (``families/gpt_oss.py``). Instead the checkpoint holds, for each:

* ``<name>_blocks``: uint8 [experts, out, in / 32, 16], the weight in [out, in] order, one block of
  32 elements in 16 bytes: element 2k in the low nibble of byte k, element 2k + 1 in the high one;
* ``<name>_scales``: uint8 [experts, out, in / 32], one E8M0 exponent per block: scale 2 ** (byte - 127).

A code (FP4 e2m1) is a sign bit over three magnitude bits that index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Dequantised: ``W[e, o, 32 g + j] = fp4(code j of block [e, o, g]) * 2 ** (scales[e, o, g] - 127)``,
transposed to the bf16 tensor's [experts, in, out]. Each such value has at most two significant bits
and an exponent fp32 and bf16 hold (the smallest, 2 ** -128, as a subnormal), so the fp32 result is
exact and casts to bf16 exactly. The E8M0 byte 255 is NaN. Biases, attention, router, embeddings and
the LM head are stored unquantised. config.json declares::

    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]}

``ExpertReader`` is the loader's hook: it reads one expert's blocks and scales (never the whole
layer) and gives that expert's row of the bf16 tensor in fp32.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
BLOCK = 32  # elements per scale
SCALE_BIAS = 127
FAMILIES = ("gpt_oss",)  # the families whose checkpoints are published in MXFP4
# FP4 e2m1 by code: bit 3 is the sign, bits 0-2 index the magnitude
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")


@dataclass(frozen=True)
class MXFP4:
    """A checkpoint's MXFP4 experts; ``modules_to_not_convert`` as config.json lists them."""

    modules_to_not_convert: tuple[str, ...] = ()
    kind, served = "MXFP4-quantised", "MXFP4"  # for messages


def mxfp4_experts(config) -> MXFP4 | None:
    """The MXFP4 quantisation declared in an HF config, None when it declares none or another method;
    raises a ValueError naming the field for an unknown field or value, or a family other than gpt-oss."""
    declared = getattr(config, "quantization_config", None)
    if declared is None:
        return None
    settings = declared if isinstance(declared, dict) else declared.to_dict()
    if str(settings.get("quant_method", "")).lower() != "mxfp4":
        return None

    def refuse(field: str, value, why: str) -> ValueError:
        return ValueError(f"quantization_config.{field}={value!r} is not supported: {why}")

    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise refuse("quant_method", settings["quant_method"], f"megarl reads MXFP4 expert weights of gpt-oss "
                     f"checkpoints only, this is a {model_type} checkpoint; dequantise it to bf16 first")
    unknown = sorted(set(settings) - set(_FIELDS))
    if unknown:
        raise refuse(unknown[0], settings[unknown[0]], f"megarl's MXFP4 reader knows the fields {list(_FIELDS)}")
    modules = settings.get("modules_to_not_convert") or []
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        raise refuse("modules_to_not_convert", modules, "it must be a list of module names")
    if settings.get("dequantize") not in (None, True, False):
        raise refuse("dequantize", settings["dequantize"], "it must be true or false")
    return MXFP4(tuple(modules))


def decode_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 powers of two, built from their bits (2 ** -127 is a subnormal; 255 is NaN)."""
    exponent = scales.to(torch.int32)
    values = (exponent << 23).view(torch.float32)  # 2 ** (byte - 127) for the bytes 1 to 254
    values = torch.where(exponent == 0, torch.tensor(2.0 ** -SCALE_BIAS), values)
    return torch.where(exponent == 255, torch.tensor(float("nan")), values)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., out, in] from ``blocks`` uint8 [..., out, in / 32, 16] and ``scales`` uint8 [..., out, in / 32]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., in / 32, 32], low nibble first
    values = torch.tensor(FP4_E2M1, dtype=torch.float32)[codes.long()]
    return (values * decode_scales(scales).unsqueeze(-1)).flatten(-2)


class ExpertReader:
    """Reads the packed expert tensors an MXFP4 checkpoint stores as ``<name>_blocks`` and ``<name>_scales``
    (each file it opens stays mapped until the reader is dropped)."""

    def __init__(self, model_dir: str | os.PathLike, files: dict[str, str], quantization: MXFP4 | None):
        self.model_dir, self.files, self.quantization = Path(model_dir), files, quantization
        self._open: dict[str, object] = {}
        self._last: tuple[tuple[str, int], torch.Tensor] | None = None  # gate and up come from one row

    def stores(self, name: str) -> bool:
        """Whether the checkpoint holds the tensor ``name`` as MXFP4 blocks (and, if so, declares it)."""
        blocks = name + BLOCKS_SUFFIX
        if blocks not in self.files:
            return False
        if self.quantization is None:
            raise ValueError(f"{blocks} holds MXFP4 blocks but {self.model_dir / 'config.json'} declares no "
                             "quantization_config with quant_method 'mxfp4'")
        if name + SCALES_SUFFIX not in self.files:
            raise KeyError(f"{blocks} is in the checkpoint at {self.model_dir} but its scales "
                           f"{name + SCALES_SUFFIX} are not")
        return True

    def file_of(self, name: str) -> str:
        return self.files[name + BLOCKS_SUFFIX]

    def row(self, name: str, shape: tuple[int, ...], row: int) -> torch.Tensor:
        """Row ``row`` (one expert, [in, out]) of the tensor ``name`` of ``shape`` [experts, in, out], in fp32
        (the last row read is kept: the loader asks for it again for the up part after the gate part)."""
        if self._last is not None and self._last[0] == (name, row):
            return self._last[1]
        experts, inputs, outputs = shape
        blocks, scales = self._slice(name + BLOCKS_SUFFIX), self._slice(name + SCALES_SUFFIX)
        expected = (experts, outputs, inputs // BLOCK, BLOCK // 2)
        if inputs % BLOCK or tuple(blocks.get_shape()) != expected or blocks.get_dtype() != "U8":
            raise ValueError(f"{name + BLOCKS_SUFFIX}: {blocks.get_dtype()} {tuple(blocks.get_shape())}; {name} "
                             f"{tuple(shape)} in MXFP4 needs uint8 {expected}")
        if tuple(scales.get_shape()) != expected[:3] or scales.get_dtype() != "U8":
            raise ValueError(f"{name + SCALES_SUFFIX}: {scales.get_dtype()} {tuple(scales.get_shape())}; "
                             f"{name} {tuple(shape)} in MXFP4 needs uint8 {expected[:3]}")
        values = dequantize(blocks[row:row + 1][0], scales[row:row + 1][0]).t()
        self._last = ((name, row), values)
        return values

    def full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor ``name`` [experts, in, out] in fp32, one expert at a time."""
        return torch.stack([self.row(name, shape, e) for e in range(shape[0])])

    def shape(self, name: str) -> tuple[int, ...]:
        """[experts, in, out] of the tensor ``name``, from its blocks' shape."""
        experts, outputs, groups, _ = self._slice(name + BLOCKS_SUFFIX).get_shape()
        return (experts, groups * BLOCK, outputs)

    def _slice(self, stored: str):
        file_name = self.files[stored]
        if file_name not in self._open:
            self._open[file_name] = safe_open(str(self.model_dir / file_name), framework="pt")
        return self._open[file_name].get_slice(stored)
