"""The planner against a real engine on this machine (one torchrun launch, 4 gloo ranks, fp32):

* parameters, gradients and optimizer state: the planner's bytes equal what megatron-core
  allocates on every rank (DDP's padded parameter and gradient buffers, the distributed
  optimizer's slices), for a tiny Llama with tied embeddings at TP1 / TP2+SP / PP2 (the shared
  embedding's own bucket), a tiny MoE at EP2 (expert buffers over the expert-data-parallel ranks)
  and a random model of SmolLM2-135M's shape at TP1 and PP2;
* activations: the planner's estimate is within 25% of the peak of the bytes autograd keeps for
  backward (saved-tensor hooks), with and without recompute, on every pipeline stage.
"""
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.ports import run_ranks, torchrun

from megarl.models.published import PUBLISHED

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
FIXTURES = PUBLISHED


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    work = tmp_path_factory.mktemp("plan_engine")
    make_tiny_model("llama", "tiny", work / "llama_tied", seed=0, tie_word_embeddings=True)
    make_tiny_model("llama", "small", work / "llama_small_tied", seed=0, tie_word_embeddings=True)
    make_tiny_model("qwen3_moe", "tiny", work / "qwen3_moe", seed=0)
    shutil.copytree(FIXTURES / "smollm2-135m", work / "smollm2-135m")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [*torchrun(4), str(HERE / "_engine_counts.py"), str(work)]
    done = run_ranks(command, env=env, timeout=840)
    assert done.returncode == 0, f"worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    return torch.load(work / "counts.pt", weights_only=False)


def test_parameter_gradient_and_optimizer_bytes_equal_the_engines(counts):
    for case, ranks in counts.items():
        for r in ranks:
            for what in ("params", "param_tensors", "grads", "optimizer"):
                assert r["planned"][what] == r["measured"][what], (case, r["rank"], what, r)


def test_activations_within_25_percent_of_the_saved_peak(counts):
    for case, ranks in counts.items():
        for r in ranks:
            planned, measured = r["planned"]["activations"], r["measured"]["activations"]
            assert 0.75 * measured <= planned <= 1.25 * measured, (case, r["rank"], r["stage"], planned, measured)
