"""A tiny gpt-oss checkpoint with MXFP4 experts, quantised here, and transformers' dequantisation as the reference.

``make_mxfp4_checkpoint(root)`` writes, from megarl's tiny gpt-oss (fp32; hidden 256, expert FFN 64, 8 experts):

  root/bf16     the tiny model as written (unquantised, fp32)
  root/mxfp4    its experts' ``gate_up_proj`` and ``down_proj`` quantised by ``quantize`` and stored in the published
                layout (``*_blocks``, ``*_scales``, ``quantization_config`` as the published config.json has it), the
                scales in a second safetensors file with an index
  root/dequant  root/bf16 with those experts replaced by transformers' ``convert_moe_packed_tensors`` of the blocks
                and scales (fp32, no quantization_config): what megarl must load from root/mxfp4

The reference is transformers' own dequantisation: it shares no code with ``megarl.models.mxfp4``.
"""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # as published
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
EXPERTS = [f"model.layers.{i}.mlp.experts.{proj}" for i in range(2) for proj in ("gate_up_proj", "down_proj")]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> (blocks uint8 [E, out, in / 32, 16], scales uint8 [E, out, in / 32]): per 32 inputs the
    smallest power of two that brings the largest magnitude to 6 or below, each value rounded to the nearest FP4."""
    w = weight.transpose(1, 2).float()
    groups = w.reshape(*w.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0 ** -100) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    index = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1)
    codes = (index + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def reference_dequantize(blocks, scales, dtype=torch.float32):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def make_mxfp4_checkpoint(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Write root/bf16, root/mxfp4 and root/dequant (see the module docstring); return the tiny model's tensors
    and root/dequant's."""
    from megarl.devtools.tiny_model import make_tiny_model

    make_tiny_model("gpt_oss", "tiny", root / "bf16")
    tensors = load_file(str(root / "bf16" / "model.safetensors"))
    quantized, scales, dequantized = dict(tensors), {}, dict(tensors)
    for name in EXPERTS:
        blocks, scales[name + "_scales"] = quantize(quantized.pop(name))
        quantized[name + "_blocks"] = blocks
        dequantized[name] = reference_dequantize(blocks, scales[name + "_scales"]).to(tensors[name].dtype)
    for target in ("mxfp4", "dequant"):
        shutil.copytree(root / "bf16", root / target)
        (root / target / "model.safetensors").unlink()
    save_file(dequantized, str(root / "dequant" / "model.safetensors"), metadata={"format": "pt"})
    save_file(quantized, str(root / "mxfp4" / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(scales, str(root / "mxfp4" / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in quantized},
                  **{n: "model-00002-of-00002.safetensors" for n in scales}}
    (root / "mxfp4" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((root / "mxfp4" / "config.json").read_text())
    (root / "mxfp4" / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return tensors, dequantized
