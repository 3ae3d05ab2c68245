"""The image-prompt helpers of the rollout (no engine): placeholder runs, folding, the fleet's checks."""
from types import SimpleNamespace

import pytest
from PIL import Image

from megarl.rollout.fleet import RolloutFleet
from megarl.rollout.images import check_expanded, check_images

PAD = 5


def test_check_images_names_the_prompt():
    img = Image.new("RGB", (8, 8))
    check_images([[PAD, PAD, 1], [1]], [[img], []], PAD)
    with pytest.raises(ValueError, match=r"prompt 1 has 0 image placeholders \(runs of token 5\) but 1 images"):
        check_images([[PAD, 1], [1]], [[img], [img]], PAD)
    with pytest.raises(ValueError, match="2 prompts, 1 image lists"):
        check_images([[1], [1]], [[]], PAD)
    with pytest.raises(ValueError, match="not a vision-language model"):
        check_images([[1]], [[img]], None)
    with pytest.raises(ValueError, match="were not resized by the same rule"):
        check_expanded("request 3", [1, PAD, PAD], [1, PAD, PAD, PAD], 0)


def test_a_backend_without_the_images_trait_refuses_image_prompts():
    img = Image.new("RGB", (8, 8))
    for name, serves in (("hf", False), ("vllm", True)):
        fleet = SimpleNamespace(image_token_id=PAD, backend=SimpleNamespace(
            name=name, traits=lambda serves=serves: {"images": serves}))
        if serves:
            assert RolloutFleet._check_images(fleet, [[PAD, 1]], [[img]]) == [[img]]
        else:
            with pytest.raises(ValueError, match="rollout.name=vllm"):
                RolloutFleet._check_images(fleet, [[PAD, 1]], [[img]])
        assert RolloutFleet._check_images(fleet, [[1]], [[]]) is None  # text only: nothing to send
