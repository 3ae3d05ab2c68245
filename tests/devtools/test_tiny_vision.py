"""The tiny vision-language checkpoints load as the published ones do: transformers' model class and
AutoProcessor (chat template with image parts, image resizing within the tiny bounds), and they run."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from megarl.devtools.tiny_model import make_tiny_model
from megarl.devtools.tiny_vision import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS, VISION_LANGUAGE_FAMILIES

FAMILIES = sorted(VISION_LANGUAGE_FAMILIES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_vl")
    return {family: make_tiny_model(family, "tiny", root / family) for family in FAMILIES}


def image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoint_loads_whole_and_runs_on_images_of_several_sizes(family, checkpoints):
    path = checkpoints[family]
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ == VISION_LANGUAGE_FAMILIES[family].model_class
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    inputs = processor(text=[text], images=[image(60, 90, 0), image(300, 40, 1)], return_tensors="pt")
    config = AutoConfig.from_pretrained(path)
    tokens_per_image = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
    assert all(MIN_IMAGE_TOKENS <= n <= MAX_IMAGE_TOKENS for n in tokens_per_image), tokens_per_image
    assert (inputs["input_ids"] == config.image_token_id).sum().item() == sum(tokens_per_image)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_seed_writes_the_same_files(family, checkpoints, tmp_path):
    again = make_tiny_model(family, "tiny", tmp_path / family)
    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (checkpoints[family] / name).read_bytes(), name
    assert json.loads((again / "preprocessor_config.json").read_text())["image_processor_type"] == "Qwen2VLImageProcessor"


def test_a_vision_language_reward_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vision-language model"):
        make_tiny_model("qwen2_5_vl", "tiny", tmp_path / "rm", head="seq_cls")


def test_qwen3_vl_moe_stores_its_packed_experts_as_published(checkpoints):
    """gate_up_proj [experts, hidden, 2 * ffn] (gate first) and down_proj [experts, ffn, hidden], as Qwen published them
    and vLLM reads them; transformers (which saves its own [experts, 2 * ffn, hidden]) loads them transposed."""
    from safetensors import safe_open

    path = checkpoints["qwen3_vl_moe"]
    text = AutoConfig.from_pretrained(path).text_config
    hidden, ffn, experts = text.hidden_size, text.moe_intermediate_size, text.num_experts
    assert 2 * ffn != hidden  # neither tensor is square: a transposed one shows in its shape
    model = AutoModelForImageTextToText.from_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for layer in range(text.num_hidden_layers):
            p = f"model.language_model.layers.{layer}.mlp.experts."
            gate_up, down = f.get_tensor(p + "gate_up_proj"), f.get_tensor(p + "down_proj")
            assert gate_up.shape == (experts, hidden, 2 * ffn) and down.shape == (experts, ffn, hidden)
            loaded = model.model.language_model.layers[layer].mlp.experts
            assert torch.equal(loaded.gate_up_proj, gate_up.transpose(1, 2)) and torch.equal(loaded.down_proj, down.transpose(1, 2))
