"""One image entry: every form verl accepts decodes, bad ones name their reason, and the resize is the processor's."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from PIL import Image

from megarl.data.images import BadImage, decode_image, pixel_inputs, resize_image, resize_rule
from tests.data.conftest import VISION_FAMILIES
from tests.data.vision_helpers import noise_image, png


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == b.mode == "RGB" and a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


def test_every_verl_entry_form_decodes_to_the_same_rgb_image(tmp_path, monkeypatch):
    image = noise_image(20, 30, seed=1)
    (tmp_path / "img.png").write_bytes(png(image))
    monkeypatch.chdir(tmp_path)  # relative paths: from the working directory, as verl opens them
    data_url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    forms = [
        image, image.convert("L").convert("RGB"),  # a PIL image
        {"bytes": png(image), "path": None}, {"bytes": png(image), "path": "ignored/name.png"},  # datasets' Image
        {"bytes": None, "path": "img.png"}, {"path": str(tmp_path / "img.png")},  # a file
        {"image": image}, {"image": "img.png"}, {"image": f"file://{tmp_path / 'img.png'}"},  # qwen_vl_utils'
        {"image": data_url}, {"image_url": "img.png"},
    ]
    for form in forms:
        decoded = decode_image(form)
        expected = form if form is forms[1] else image
        assert _same(decoded, expected), form if isinstance(form, dict) else type(form)


def test_transparent_and_grey_images_become_rgb_on_white():
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    decoded = decode_image({"bytes": png(rgba)})
    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (10, 20, 30)
    assert decoded.getpixel((1, 0)) == (255, 255, 255)  # transparent: white, not the black of convert("RGB")
    grey = noise_image(3, 5, mode="L")
    assert decode_image({"bytes": png(grey)}).getpixel((2, 1)) == (grey.getpixel((2, 1)),) * 3


@pytest.mark.parametrize("entry, reason", [
    ({"bytes": b"not an image at all"}, "undecodable image"),
    ({"bytes": png(noise_image(8, 8))[:40]}, "undecodable image"),  # truncated
    ({"path": "/no/such/image.png"}, "missing image file"),
    ({"bytes": None, "path": "missing.png"}, "missing image file"),
    ({"image": "https://example.com/a.png"}, "remote image URL"),
    ({"image": "data:image/png;base64,@@@"}, "undecodable image"),
    ({"bytes": None, "path": None}, "not an image entry"),
    ("img.png", "not an image entry"),
    ({"bytes": "text"}, "not an image entry"),
])
def test_bad_entries_name_their_reason(entry, reason):
    with pytest.raises(BadImage) as info:
        decode_image(entry)
    assert info.value.reason == reason


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_resized_images_give_the_processors_own_pixels(vision_models, family):
    """pixel_inputs on the stored, resized images == the processor on the originals (either backend), so the
    engine and the trainer can both be fed the stored image; the token counts are the processor's grids."""
    from transformers import AutoImageProcessor

    _, processor, path = vision_models[family]
    rule = resize_rule(processor)
    unit = {"qwen2_5_vl": 28, "qwen3_vl": 32}[family]
    assert (rule.factor, rule.min_pixels, rule.max_pixels) == (unit, unit * unit * 4, unit * unit * 64)
    originals = [noise_image(h, w, seed=i) for i, (h, w) in enumerate([(50, 90), (300, 200), (20, 20), (56, 64),
                                                                       (900, 37), (unit * 3, unit * 5)])]
    pil_backend = AutoImageProcessor.from_pretrained(path, backend="pil")
    assert (processor.image_processor.backend, pil_backend.backend) == ("torchvision", "pil")
    for image_processor in (processor.image_processor, pil_backend):
        proc = type("P", (), {"image_processor": image_processor})()
        resized = [resize_image(image, proc) for image in originals]
        expected = image_processor(images=originals, return_tensors="pt")
        got = pixel_inputs([image for image, _ in resized], proc)
        assert torch.equal(got["pixel_values"], expected["pixel_values"])
        assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
        merge = image_processor.merge_size ** 2
        assert [tokens for _, tokens in resized] == (expected["image_grid_thw"].prod(-1) // merge).tolist()
        assert all(image.width % unit == 0 and image.height % unit == 0 for image, _ in resized)
    assert resize_image(originals[-1], processor)[0] is originals[-1]  # already on the grid: kept as is


def test_extreme_aspect_ratios_are_bad_images(vision_models):
    _, processor, _ = vision_models["qwen2_5_vl"]
    with pytest.raises(BadImage, match="unsupported aspect ratio"):
        resize_image(noise_image(2, 500), processor)  # over 200:1
    with pytest.raises(BadImage, match="does not keep its size"):  # 28 x 5000 cannot fit 64 tokens of 28 px
        resize_image(noise_image(28, 5000), processor)


def test_a_processor_that_is_not_qwen_style_is_refused():
    processor = type("P", (), {"image_processor": object()})()
    with pytest.raises(ValueError, match="not a Qwen-VL style one.*patch_size, merge_size"):
        resize_rule(processor)
    with pytest.raises(ValueError, match="at least one image"):
        pixel_inputs([], processor)
