"""One image of a vision-language prompt: decoded from verl's parquet entry, resized once by the model's rule.

verl's multimodal rows hold a list of images per row (``data.image_key``, default ``images``); an
entry is one of the forms verl's dataset accepts:

- ``{"bytes": <encoded image>, "path": ...}``: what ``datasets`` writes for an ``Image`` feature
  (verl's ``examples/data_preprocess/geo3k.py``); the bytes win, the path is only a name;
- ``{"bytes": None, "path": "<file>"}`` or ``{"path": "<file>"}``: an image file;
- ``{"image": <PIL image | path | "file://..." | "data:image/...;base64,...">}``: qwen_vl_utils'
  form (``"image_url"`` is read as ``"image"``);
- a PIL image.

A relative path is opened relative to the process's working directory, as verl does (``datasets``
and qwen_vl_utils both hand it to ``PIL.Image.open``), not relative to the parquet file. Remote
URLs are not fetched (the data is prepared before any process starts): download them first.

The decoded image becomes RGB; a transparent one is laid on white first, as Qwen's qwen_vl_utils
does (a plain ``convert("RGB")`` would turn a transparent background black). It is then resized by
the model's image processor, read from the ``AutoProcessor`` (Qwen's ``smart_resize``: both sides
multiples of ``patch_size * merge_size``, the area within the processor's min/max pixels), with the
processor's own resampling, so that the stored image is what the processor would have made of the
original: ``pixel_inputs`` on it gives exactly the processor's pixel values for the original, and
the engine and the trainer can both be fed the stored image. Its image tokens are
``(height / factor) * (width / factor)``.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any, Sequence

from PIL import Image


class BadImage(ValueError):
    """An image entry that cannot be used; ``reason`` is short and the same for every such entry (it is counted)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def decode_image(entry: Any) -> Image.Image:
    """The RGB image of one verl image entry (the forms in the module docstring); ``BadImage`` otherwise."""
    if isinstance(entry, Image.Image):
        return to_rgb(entry)
    if not isinstance(entry, dict):
        raise BadImage("not an image entry", f"expected a dict with 'bytes', 'path' or 'image', got "
                                            f"{type(entry).__name__}")
    if entry.get("bytes") is not None:
        data = entry["bytes"]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadImage("not an image entry", f"'bytes' holds {type(data).__name__}, not bytes")
        return _open(io.BytesIO(bytes(data)), "encoded bytes")
    source = entry.get("image", entry.get("image_url"))
    if isinstance(source, Image.Image):
        return to_rgb(source)
    if source is None:
        source = entry.get("path")
    if not isinstance(source, str) or not source:
        raise BadImage("not an image entry", f"no 'bytes', 'path' or 'image' in the entry (keys {sorted(entry)})")
    return _open_source(source)


def _open_source(source: str) -> Image.Image:
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        try:
            return _open(io.BytesIO(base64.b64decode(payload, validate=True)), "base64 data")
        except binascii.Error as exc:
            raise BadImage("undecodable image", f"{head}: not base64 ({exc})") from None
    if source.startswith(("http://", "https://")):
        raise BadImage("remote image URL", f"{source!r:.120} (download the images and store bytes or local paths)")
    path = source[len("file://"):] if source.startswith("file://") else source
    if not os.path.isfile(path):
        raise BadImage("missing image file", f"{path!r} (relative paths are read from the working directory "
                                             f"{os.getcwd()!r}, as verl does)")
    return _open(path, path)


def _open(source: Any, name: str) -> Image.Image:
    try:
        with Image.open(source) as image:
            image.load()
            return to_rgb(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadImage("undecodable image", f"{name}: {exc}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; a transparent image (alpha or a transparent palette colour) laid on white first."""
    if image.mode == "RGB":
        return image.copy()
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ResizeRule:
    """The image processor's resize rule: Qwen's ``smart_resize`` with its bounds and its patch grid."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int

    @property
    def factor(self) -> int:
        """Pixels per image token along one side."""
        return self.patch_size * self.merge_size

    def target(self, height: int, width: int) -> tuple[int, int]:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        try:
            return smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels,
                                max_pixels=self.max_pixels)
        except ValueError as exc:  # an aspect ratio over 200
            raise BadImage("unsupported aspect ratio", f"{width}x{height}: {exc}") from None

    def tokens(self, height: int, width: int) -> int:
        return (height // self.factor) * (width // self.factor)


def resize_rule(processor: Any) -> ResizeRule:
    """The rule of ``processor.image_processor`` (a Qwen-VL style one: patch and merge sizes, min/max pixels)."""
    image_processor = getattr(processor, "image_processor", None)
    size = getattr(image_processor, "size", None) or {}
    read = (lambda key: size.get(key)) if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    min_pixels = read("shortest_edge") or getattr(image_processor, "min_pixels", None)
    max_pixels = read("longest_edge") or getattr(image_processor, "max_pixels", None)
    patch_size = getattr(image_processor, "patch_size", None)
    merge_size = getattr(image_processor, "merge_size", None)
    if None in (min_pixels, max_pixels, patch_size, merge_size) or not getattr(image_processor, "do_resize", True):
        raise ValueError(
            f"the processor's image processor ({type(image_processor).__name__}) is not a Qwen-VL style one: megarl "
            "needs its patch_size, merge_size, min and max pixels (size.shortest_edge / size.longest_edge) and "
            "do_resize=True, as Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's preprocessor_config.json have them")
    return ResizeRule(int(min_pixels), int(max_pixels), int(patch_size), int(merge_size))


def resize_image(image: Image.Image, processor: Any, rule: ResizeRule | None = None) -> tuple[Image.Image, int]:
    """``image`` (RGB) resized as the processor resizes it, and its number of image tokens.

    The size comes from ``rule`` (``resize_rule(processor)``); the pixels from the processor's own
    resampling (its backend: torchvision or PIL), checked to land on that size. An image whose size
    would change again on a second resize (an extreme aspect ratio that the pixel bounds cannot
    hold) is a ``BadImage``: the engine would see other tokens than the stored ones.
    """
    rule = rule or resize_rule(processor)
    height, width = rule.target(image.height, image.width)
    if rule.target(height, width) != (height, width):
        raise BadImage("unsupported aspect ratio", f"{image.width}x{image.height} does not keep its size under "
                                                   f"the processor's resize (min/max pixels {rule.min_pixels}/"
                                                   f"{rule.max_pixels})")
    if (height, width) == (image.height, image.width):
        return image, rule.tokens(height, width)
    image_processor = processor.image_processor
    pixels = image_processor.process_image(image, do_convert_rgb=True)  # CHW uint8, the backend's array type
    pixels = image_processor.resize(pixels, size=image_processor.size, resample=image_processor.resample,
                                    factor=rule.factor)
    import numpy as np

    array = np.asarray(pixels)
    if array.shape != (3, height, width) or array.dtype != np.uint8:
        raise RuntimeError(f"{type(image_processor).__name__}.resize made {array.shape} {array.dtype} of a "
                           f"{image.width}x{image.height} image; smart_resize expects (3, {height}, {width}) uint8")
    return Image.fromarray(np.ascontiguousarray(array.transpose(1, 2, 0)), "RGB"), rule.tokens(height, width)


def pixel_inputs(images: Sequence[Image.Image], processor: Any) -> dict[str, Any]:
    """``{"pixel_values", "image_grid_thw"}`` (torch tensors) of a sample's resized images, by the processor."""
    if not images:
        raise ValueError("pixel_inputs needs at least one image (a text-only sample has no pixel inputs)")
    out = processor.image_processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
