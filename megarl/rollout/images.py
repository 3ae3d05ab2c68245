"""Image prompts for the rollout: what the fleet checks and what an engine is handed.

A vision-language prompt reaches the fleet as the token ids the model sees, each image's
``<|image_pad|>`` token already repeated once per image token (the data loader resized the image by
the model's processor rule and counted them), plus the sample's images. vLLM wants the other form:
one ``<|image_pad|>`` per image in the prompt ids, and the images; its own processor then repeats
the token. ``collapse_image_tokens`` (the data loader's) gives that form, and the engine's expanded prompt must come back
equal to the fleet's (``check_expanded``): the trainer computes log-probs over those ids, so a
different image-token count would misalign every position after the image.
"""
from __future__ import annotations

from typing import Any, Sequence

from megarl.data.image_prompts import collapse_image_tokens, image_spans

__all__ = ["check_expanded", "check_images", "collapse_image_tokens"]


def check_images(prompts: Sequence[Sequence[int]], images: Sequence[Sequence[Any]], image_token_id: int | None) -> None:
    """One image per run of image tokens in each prompt, and real images; a ValueError naming the prompt."""
    from PIL import Image

    if isinstance(images, (str, bytes)) or len(images) != len(prompts):
        raise ValueError(f"images must be one sequence of images per prompt: {len(prompts)} prompts, "
                         f"{len(images) if hasattr(images, '__len__') else type(images).__name__} image lists")
    for i, (ids, sample) in enumerate(zip(prompts, images)):
        bad = [type(x).__name__ for x in sample if not isinstance(x, Image.Image)]
        if bad:
            raise ValueError(f"images[{i}] must hold PIL images (the data loader's resized images), got {bad}")
        if image_token_id is None:
            if sample:
                raise ValueError(f"images[{i}] holds {len(sample)} images, but the rollout model is not a "
                                 "vision-language model (its config has no image_token_id)")
            continue
        runs = len(image_spans(ids, image_token_id))
        if runs != len(sample):
            raise ValueError(f"prompt {i} has {runs} image placeholders (runs of token {image_token_id}) but "
                             f"{len(sample)} images; each image needs its own placeholder in the prompt")


def check_expanded(request: str, sent: Sequence[int], expanded: Sequence[int], replica: int) -> None:
    """The engine's prompt after its processor repeated the image tokens must be the fleet's prompt."""
    if list(expanded) != list(sent):
        raise ValueError(
            f"replica {replica}: {request}: the engine's processor made {len(expanded)} prompt tokens "
            f"from its images where the data loader counted {len(sent)}: the images were not resized by the same "
            "rule (the checkpoint's preprocessor_config.json min_pixels/max_pixels); give the rollout the images "
            "as the data loader resized them")
