"""The prompt of a row with images: verl's ``<image>`` placeholders, the image tokens, and the rows skipped.

verl writes each image of a row as ``<image>`` in a message's text (``examples/data_preprocess``),
in the order of the row's ``data.image_key`` list. Here, as in verl's dataset, a message with
placeholders becomes content parts (``{"type": "image"}`` and ``{"type": "text", "text": ...}``,
empty text left out) that the chat template renders as ``<|vision_start|><|image_pad|><|vision_end|>``;
each ``<|image_pad|>`` is then expanded to the image's token count, so that the prompt ids are
exactly what the model sees (the processor's own ``input_ids``) and the prompt's length counts them.

With a processor every row is checked so (a text row: no placeholders, no images), so that a wrong
``data.image_key`` cannot turn image prompts into text. A row whose images cannot be used is skipped and counted by reason (``SkippedRows``), as verl's
filter skips a sample that fails: placeholders and images that do not pair up, an image that does
not decode or whose file is missing, a truncation that would cut through an image's tokens.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from PIL import Image

from megarl.data.images import BadImage, ResizeRule, decode_image, resize_image

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "<image>", "<video>"
_SHOWN = 3  # locations named per reason


def image_messages(messages: Sequence[dict[str, str]], num_images: int) -> list[dict[str, Any]]:
    """The messages with every ``<image>`` turned into an image part (text between them into text parts).

    ``BadImage`` when the placeholders and the ``num_images`` images do not pair up one to one, or a
    ``<video>`` placeholder is present (megarl does not train on video).
    """
    placeholders = sum(message["content"].count(IMAGE_PLACEHOLDER) for message in messages)
    if any(VIDEO_PLACEHOLDER in message["content"] for message in messages):
        raise BadImage("a <video> placeholder", "megarl does not train on video yet")
    if placeholders > num_images:
        hint = " (is data.image_key the column of the images?)" if not num_images else ""
        raise BadImage("more <image> placeholders than images",
                       f"{placeholders} placeholders, {num_images} images{hint}")
    if placeholders < num_images:
        raise BadImage("fewer <image> placeholders than images", f"{placeholders} placeholders, {num_images} images")
    out = []
    for message in messages:
        if IMAGE_PLACEHOLDER not in message["content"]:
            out.append(dict(message))
            continue
        parts = [{"type": "image"} if piece == IMAGE_PLACEHOLDER else {"type": "text", "text": piece}
                 for piece in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", message["content"]) if piece]
        out.append({**message, "content": parts})
    return out


@dataclass(frozen=True)
class ImagePrompt:
    """A row's messages with image parts, its resized images (in placeholder order) and their token counts."""

    messages: list[dict[str, Any]]
    images: tuple[Image.Image, ...]
    tokens: tuple[int, ...]


def image_prompt(messages: Sequence[dict[str, str]], entries: Sequence[Any], processor: Any,
                 rule: ResizeRule) -> ImagePrompt:
    """Placeholders paired with ``entries`` (verl's image entries), each decoded and resized; ``BadImage`` else."""
    parts = image_messages(messages, len(entries))
    resized = [resize_image(decode_image(entry), processor, rule) for entry in entries]
    return ImagePrompt(parts, tuple(image for image, _ in resized), tuple(tokens for _, tokens in resized))


def expand_image_tokens(ids: Sequence[int], image_token_id: int, tokens: Sequence[int]) -> list[int]:
    """``ids`` with the i-th ``image_token_id`` repeated ``tokens[i]`` times; ``BadImage`` when the
    template rendered another number of image tokens than there are images."""
    found = sum(1 for token in ids if token == image_token_id)
    if found != len(tokens):
        raise BadImage("image tokens do not match the images",
                       f"the templated prompt has {found} image tokens for {len(tokens)} images (the chat template "
                       "must render image parts, and the text must not hold the image token itself)")
    out: list[int] = []
    counts = iter(tokens)
    for token in ids:
        out.extend([token] * next(counts) if token == image_token_id else [token])
    return out


def collapse_image_tokens(ids: Sequence[int], image_token_id: int, num_images: int) -> list[int]:
    """``ids`` with each image's run of image tokens back to one token: the prompt form vLLM takes with
    ``multi_modal_data`` (its processor expands each image token itself; an expanded prompt would be expanded
    again). The inverse of ``expand_image_tokens`` for templates that put markers around images, as Qwen's do."""
    out = [token for i, token in enumerate(ids) if token != image_token_id or i == 0 or ids[i - 1] != image_token_id]
    runs = sum(1 for token in out if token == image_token_id)
    if runs != num_images:
        raise ValueError(f"the prompt has {runs} runs of image tokens for {num_images} images")
    return out


def image_spans(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each image in ``ids``: its run of image tokens and the marker on either side."""
    spans, start = [], None
    for i, token in enumerate(ids):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            spans.append((max(0, start - 1), i + 1))
            start = None
    if start is not None:
        spans.append((max(0, start - 1), len(ids)))
    return [(a, min(b, len(ids))) for a, b in spans]


class SkippedRows:
    """Rows left out of the dataset, by reason: their count and the first few ``file: row`` locations."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.shown: dict[str, list[str]] = {}

    def add(self, source_file: str, row_number: int, error: BadImage) -> None:
        self.counts[error.reason] += 1
        shown = self.shown.setdefault(error.reason, [])
        if len(shown) < _SHOWN:
            shown.append(f"{source_file}: row {row_number} ({error})")

    def __len__(self) -> int:
        return sum(self.counts.values())

    def summary(self, total: int) -> str:
        """``skipped 3 of 10 rows: 2 undecodable image (f: row 1 (...); ...); 1 ...``"""
        parts = []
        for reason, count in self.counts.most_common():
            more = f"; and {count - len(self.shown[reason])} more" if count > len(self.shown[reason]) else ""
            parts.append(f"{count} {reason} ({'; '.join(self.shown[reason])}{more})")
        return f"skipped {len(self)} of {total} rows: " + "; ".join(parts)
