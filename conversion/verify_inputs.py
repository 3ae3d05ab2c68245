"""The inputs ``verify`` runs both models on: token ids, positions, and for a vision-language model an image.

A causal LM gets the sample texts, right-padded into one batch, with positions ``0..S-1``. A
vision-language model (Qwen2.5-VL, Qwen3-VL: ``ModelDims.vision``) gets the same texts plus one row made by
its own processor from a chat turn holding a fixed synthetic image, so that the vision tower's weights are
compared too; its positions are M-RoPE's ``[3, B, S]`` (``megarl.models.mrope.mrope_position_ids``,
transformers' ``get_rope_index``), and transformers' reference is ``AutoModelForImageTextToText`` on the
same ids and pixels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

IMAGE_PROMPT = "Describe the picture."


@dataclass
class VerifyBatch:
    input_ids: torch.Tensor  # [B, S], right-padded
    position_ids: torch.Tensor  # [1, S] (1-D RoPE) or [3, B, S] (M-RoPE)
    pixel_values: torch.Tensor | None = None  # the image row's patches
    image_grid_thw: torch.Tensor | None = None
    image_rows: tuple[int, ...] = field(default_factory=tuple)  # rows holding the images (one image each)
    image_token_id: int | None = None

    def micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
        """One row at a time: ``(input_ids [1, S], position_ids, extra forward kwargs)``."""
        out = []
        for b in range(self.input_ids.shape[0]):
            positions = self.position_ids if self.position_ids.dim() == 2 else self.position_ids[:, b:b + 1]
            extra = {}
            if b in self.image_rows:
                extra = dict(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
            out.append((self.input_ids[b:b + 1], positions, extra))
        return out

    def hf_kwargs(self) -> dict:
        """transformers' forward arguments besides ``input_ids``."""
        if self.pixel_values is None:
            return {}
        return dict(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                    mm_token_type_ids=(self.input_ids == self.image_token_id).long())


def synthetic_image(size: int = 56):
    """A fixed RGB picture (gradients and a square), the same on every rank and run."""
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 255 // size, y * 255 // size, ((x // 8 + y // 8) % 2) * 255], -1).astype(np.uint8)
    return Image.fromarray(pixels)


def verify_batch(hf_dir, texts) -> VerifyBatch:
    from transformers import AutoTokenizer

    from megarl.models import model_dims

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    if not all(rows):
        raise ValueError("every --text must produce at least one token")
    vision = model_dims(hf_dir).vision
    image = None
    if vision is not None:
        image = _image_row(hf_dir)
        rows.append(image["input_ids"][0].tolist())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    longest = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [pad] * (longest - len(row)) for row in rows])
    if vision is None:
        return VerifyBatch(input_ids, torch.arange(longest).unsqueeze(0))
    from megarl.models.mrope import mrope_position_ids

    image_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    image_mask[-1, :len(rows[-1])] = input_ids[-1, :len(rows[-1])] == vision.image_token_id
    positions = mrope_position_ids(input_ids, image["image_grid_thw"], None, image_token_id=vision.image_token_id,
                                   spatial_merge_size=vision.spatial_merge_size, image_mask=image_mask)
    return VerifyBatch(input_ids, positions, image["pixel_values"].float(), image["image_grid_thw"],
                       (len(rows) - 1,), vision.image_token_id)


def _image_row(hf_dir) -> dict:
    """The processor's ids and pixels of one user turn: the synthetic image, then ``IMAGE_PROMPT``."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(hf_dir))
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": IMAGE_PROMPT}]}]
    text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[synthetic_image()], return_tensors="pt")
