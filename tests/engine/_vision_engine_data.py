"""Shared by the vision-language engine tests and their torchrun worker: an RL batch of image and text samples
from the tiny Qwen2.5-VL / Qwen3-VL checkpoints (``tests/models/vision_fixture``), and Hugging Face's log-probs of
its responses.

The batch is verl's layout: the processor's prompts LEFT-padded (two images of different sizes in one prompt, a
text prompt, one image, a short text prompt), seeded text responses of 1..5 tokens RIGHT-padded; each sample's
``multi_modal_inputs`` hold its own images' patches and grids ({} for a text sample).
"""
from __future__ import annotations

from pathlib import Path

import torch

from megarl.engine.batch import RLBatch
from tests.models.vision_fixture import FAMILIES, ROWS, chat_texts, images  # noqa: F401  (FAMILIES for the tests)

RESPONSE = 5


def image_batch(checkpoint: Path, family: str, seed: int = 0) -> RLBatch:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(checkpoint))
    processor.tokenizer.padding_side = "left"
    prompts = processor(text=chat_texts(processor), images=images(family), return_tensors="pt", padding=True)
    grids, pixels = prompts["image_grid_thw"], prompts["pixel_values"]
    samples, image, patch = [], 0, 0
    for count, _ in ROWS:
        grid = grids[image:image + count]
        patches = int(grid.prod(dim=1).sum())
        samples.append({"pixel_values": pixels[patch:patch + patches], "image_grid_thw": grid} if count else {})
        image, patch = image + count, patch + patches
    generator = torch.Generator().manual_seed(seed)
    batch_size = len(ROWS)
    special = set(processor.tokenizer.all_special_ids)
    text_ids = torch.tensor([i for i in range(3, 300) if i not in special])
    responses = text_ids[torch.randint(len(text_ids), (batch_size, RESPONSE), generator=generator)]
    lengths = torch.tensor([3, 5, 1, 4])[:batch_size]
    response_mask = (torch.arange(RESPONSE).unsqueeze(0) < lengths.unsqueeze(1)).long()
    shape = (batch_size, RESPONSE)
    return RLBatch.from_parts(prompts["input_ids"], prompts["attention_mask"], responses * response_mask, response_mask,
                              advantages=torch.randn(shape, generator=generator) * response_mask,
                              multi_modal_inputs=samples)


class WithImages(torch.nn.Module):
    """HF's vision-language model called as the text reference (``tests/engine/_engine_hf``) calls a causal LM:
    ``model(input_ids=, attention_mask=, position_ids=)``; the images of ``batch`` go along, the prompts' image
    tokens marked in ``mm_token_type_ids`` and the M-RoPE positions left to HF (``get_rope_index``)."""

    def __init__(self, model: torch.nn.Module, batch: RLBatch):
        super().__init__()
        self.model, self.batch = model, batch

    def forward(self, input_ids, attention_mask, position_ids=None):
        pixels = self.batch.pixel_inputs()
        image_mask = (input_ids == self.model.config.image_token_id) & attention_mask.bool()
        image_mask[:, self.batch.prompt_length:] = False  # a response holds no image
        return self.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels[0],
                          image_grid_thw=pixels[1], mm_token_type_ids=image_mask.int())

    def save_pretrained(self, directory):
        self.model.save_pretrained(directory)


def hf_log_probs(checkpoint: Path, batch: RLBatch) -> torch.Tensor:
    """HF's (fp32, eager) log-probs ``[B, R]`` of the responses, 0 at padding."""
    import _engine_hf

    from tests.models.vision_fixture import hf_model

    with torch.no_grad():
        model = WithImages(hf_model(checkpoint), batch)
        return _engine_hf.log_probs_and_entropy(_engine_hf.response_outputs(model, batch), batch)[0]
