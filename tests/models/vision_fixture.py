"""Tiny Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints, an image + text batch, and transformers' outputs on it.

``make_vision_zoo(root)`` writes ``root/<family>`` for each of ``ZOO`` (``megarl.devtools.tiny_model``)
and ``root/vision_reference.pt``: per family the processor's batch, HF's fp32 logits (eager attention) and the
gradients of the vision tower's tensors (``tower_grads``, by name below ``visual.``) of the sum of the real
tokens' logits.
The batch (``ROWS``) has a row with two images of different sizes, a text-only row, a row with one
more image and a short text-only row; rows are right-padded (each row's real tokens on the left, as the
engine's padded layout feeds the model), so a causal mask is all the model needs. Images are seeded
noise, sized in multiples of each tower's 2 x 2 merged patch (28 or 32 pixels).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # the dense ones, which every vision test runs (the engine's too)
MOE_FAMILIES = ("qwen3_vl_moe",)  # the bridge's logits, export and sync splits (tests/models), and EP 2
ZOO = FAMILIES + MOE_FAMILIES
UNIT = {"qwen2_5_vl": 28, "qwen3_vl": 32, "qwen3_vl_moe": 32}  # pixels per image token side
ROWS = ((2, "two pictures: what differs?"), (0, "only words here, no picture at all"), (1, "describe"), (0, "hi"))
IMAGE_UNITS = ((2, 3), (4, 2), (2, 2))  # each image's (height, width) in merged image tokens, in order


def images(family: str) -> list:
    from PIL import Image

    rng = np.random.default_rng(0)
    unit = UNIT[family]
    return [Image.fromarray(rng.integers(0, 255, (h * unit, w * unit, 3), dtype=np.uint8)) for h, w in IMAGE_UNITS]


def chat_texts(processor) -> list[str]:
    texts = []
    for count, words in ROWS:
        content = [{"type": "image"}] * count + [{"type": "text", "text": words}]
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))
    return texts


def processed_batch(checkpoint: Path, family: str, padding_side: str = "right") -> dict:
    """The processor's tensors for ``ROWS`` (input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(checkpoint))
    processor.tokenizer.padding_side = padding_side
    return dict(processor(text=chat_texts(processor), images=images(family), return_tensors="pt", padding=True))


def hf_model(checkpoint: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                       attn_implementation="eager").eval()


def make_vision_zoo(root: Path) -> Path:
    from megarl.devtools.tiny_model import make_tiny_model

    reference = {}
    for family in ZOO:
        make_tiny_model(family, "tiny", root / family, seed=0)
        batch = processed_batch(root / family, family)
        model = hf_model(root / family)
        logits = model(**batch).logits
        logits[batch["attention_mask"].bool()].sum().backward()
        tower = {name.split("visual.", 1)[1]: p.grad for name, p in model.named_parameters() if "visual." in name}
        reference[family] = {**batch, "logits": logits.detach(), "tower_grads": tower}
    torch.save(reference, root / "vision_reference.pt")
    return root
