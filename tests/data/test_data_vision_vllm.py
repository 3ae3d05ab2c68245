"""The dataset's items as vLLM's multimodal processor takes them (no engine: vLLM's processor only).

vLLM expands each image token itself, so it is given the collapsed prompt (``collapse_image_tokens``) and the
stored, resized images: it must arrive at exactly the item's ``prompt_ids`` and at the pixels the processor
makes of the original images (vLLM 0.32 ships them as uint8 patches and normalises on the device). Given the expanded ids, vLLM would
expand them again."""
from __future__ import annotations

import pytest
import torch

from megarl.data import PromptDataset, collapse_image_tokens
from tests.data.conftest import VISION_FAMILIES
from tests.data.data_helpers import write_parquet
from tests.data.test_data_vision import _image_row
from tests.data.vision_helpers import noise_image, png

pytestmark = pytest.mark.vllm  # importing vLLM's model code starts a process: the heavy phase


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_vllm_sees_the_items_prompt_ids_and_the_processors_pixels(tmp_path, vision_models, family):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    tokenizer, processor, path = vision_models[family]
    originals = [noise_image(56, 84, seed=1), noise_image(300, 200, seed=2)]
    rows = [_image_row("<image> or <image>?", [{"bytes": png(image)} for image in originals], 0)]
    item = PromptDataset(write_parquet(rows, tmp_path / "t.parquet"), tokenizer, processor=processor)[0]

    engine = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(path), dtype="float32"))
    def engine_input(prompt):
        items = engine.info.parse_mm_data({"image": list(item.images)})
        return engine.apply(ProcessorInputs(prompt=list(prompt), mm_data_items=items), TimingContext())

    out = engine_input(collapse_image_tokens(item.prompt_ids, processor.image_token_id, len(item.images)))
    assert out["prompt_token_ids"] == item.prompt_ids
    assert len(engine_input(item.prompt_ids)["prompt_token_ids"]) > len(item.prompt_ids)  # expanded twice
    raw = processor.image_processor(images=originals, do_rescale=False, do_normalize=False, return_tensors="pt")
    seen = [kwargs.get_data() for kwargs in out["mm_kwargs"]["image"]]
    assert torch.equal(torch.cat([s["pixel_values"] for s in seen]).float(), raw["pixel_values"])
    assert torch.equal(torch.stack([s["image_grid_thw"] for s in seen]), raw["image_grid_thw"])
