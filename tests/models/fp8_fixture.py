"""A tiny FP8 block-quantised checkpoint, quantised here, and an independent dequantisation reference.

``make_fp8_checkpoint(root)`` writes, from one seeded random Llama whose sizes are *not* multiples
of 128 (hidden 192, FFN 320, 6 heads of 32, 2 KV groups), so TP slices cut through blocks and every
weight has ragged last blocks:

  root/fp8      every 2-D linear weight as float8_e4m3fn + ``<name>_scale_inv`` (fp32, 128x128
                blocks), DeepSeek-V3's format; embeddings and norms unquantised (fp32); two
                safetensors files with an index, one layer's scales stored in the *other* file
  root/dequant  the same checkpoint dequantised by ``reference_dequantize`` (fp32, no
                quantization_config): what transformers runs as the reference

The reference dequantises block by block with explicit loops: it shares no code with
``megarl.models.fp8``.
"""
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "fmt": "e4m3", "activation_scheme": "dynamic"}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale_inv [ceil(r/128), ceil(c/128)]): each block scaled to its amax."""
    rows, cols = weight.shape
    scales = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scales[i, j] = block.abs().max() / FP8_MAX
            quantized[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scales[i, j]).to(torch.float8_e4m3fn)
    return quantized, scales


def reference_dequantize(quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = quantized.shape
    out = torch.empty(rows, cols)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = quantized[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = block.to(torch.float32) * scales[i, j].item()
    return out


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name


def make_fp8_checkpoint(root: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write root/fp8 and root/dequant (see the module docstring); return the reference tensors."""
    from transformers import AutoModelForCausalLM

    from megarl.devtools.tiny_model import build_config, build_tokenizer

    tokenizer = build_tokenizer("llama", 512)
    config = build_config("llama", "tiny", special_token_ids={"bos": tokenizer.bos_token_id,
                          "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id})
    config.hidden_size, config.intermediate_size = 192, 320
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 6, 2, 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(0.1 * torch.randn_like(param))
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}

    stored, reference = {}, {}
    for name, tensor in state.items():
        if is_quantized(name, tensor):
            stored[name], stored[name + "_scale_inv"] = quantize(tensor)
            reference[name] = reference_dequantize(stored[name], stored[name + "_scale_inv"])
        else:
            stored[name] = reference[name] = tensor

    fp8, dequant = root / "fp8", root / "dequant"
    for directory in (fp8, dequant):
        directory.mkdir(parents=True)
        tokenizer.save_pretrained(directory)
    # layer 0 in one file, the rest in another, except layer 0's q_proj scale, which moves over
    moved_scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    first = {n: t for n, t in stored.items() if n.startswith("model.layers.0.") and n != moved_scale}
    second = {n: t for n, t in stored.items() if n not in first}
    weight_map = {}
    for file_name, tensors in (("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)):
        save_file(tensors, str(fp8 / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in tensors})
    (fp8 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_dict = config.to_dict() | {"architectures": ["LlamaForCausalLM"], "quantization_config": QUANTIZATION}
    (fp8 / "config.json").write_text(json.dumps(config_dict, indent=2))

    save_file(reference, str(dequant / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(dequant)
    return reference
