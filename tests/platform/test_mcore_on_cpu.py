"""megatron-core on CPU over gloo: TP, SP, PP (1F1B), MoE EP alltoall and the optimizer, and every CPU redirect.

The scenarios of ``_scenarios.py`` run in two fresh launches, shared by the tests below: one
process (TP=1, optimizer) and torchrun with 2 ranks (TP=2 with/without SP, PP=2, MoE EP=2).
Each launch first leaves out every redirect; the scenarios record the failure each one
prevents, apply it, and run to the end. The tests check the failures and the numbers.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.ports import run_ranks, torchrun

from megarl.platform import redirect_names

HERE = Path(__file__).resolve().parent
CUDA_MISSING = "Torch not compiled with CUDA enabled"
LAUNCH_TIMEOUT = 420

# How each left-out redirect must fail: substrings of "<exception> @ <megatron-core file:line: source>".
EXPECTED_FAILURES = {
    "rng_tracker": [CUDA_MISSING, "tensor_parallel/random.py", "get_rng_state"],
    "current_device": [CUDA_MISSING, "torch.cuda.current_device()"],
    "cuda_device_literals": [CUDA_MISSING, 'device="cuda"'],
    "cuda_type_names": ["clip_grads.py", "torch.cuda.FloatTensor"],
    "sequence_parallel_norm": ["sequence parallel not supported by torch LayerNorm"],
    "tensor_cuda_method": [CUDA_MISSING, "language_module.py", ".cuda()"],
    "synchronize": [CUDA_MISSING, "p2p_communication.py", "torch.cuda.synchronize()"],
    "streams": ["torch.cuda.Stream requires CUDA support", "token_dispatcher.py"],
    "moe_split_sizes_numpy": ["all_to_all_single(): incompatible function arguments"],
    "moe_router_without_te": ["name 'te_general_gemm' is not defined"],
    "checkpoint_without_output_fp8": ["name 'FP8GlobalStateManager' is not defined", "tensor_parallel/random.py"],
    "mla_without_te": ["isinstance() arg 2 must be a type", "multi_latent_attention.py", "TELinear"],
    "grouped_gemm": ["Grouped GEMM is not available", "grouped_gemm_util.py"],
}
SINGLE_PROCESS = (["tp1", "optimizer", "selective_recompute", "mla", "grouped_gemm"],
                  ["rng_tracker", "current_device", "cuda_device_literals", "cuda_type_names",
                   "checkpoint_without_output_fp8", "mla_without_te", "grouped_gemm"])
TWO_RANKS = (
    ["tp2", "pp2", "moe_ep2"],
    [
        "sequence_parallel_norm",
        "tensor_cuda_method",
        "synchronize",
        "streams",
        "moe_split_sizes_numpy",
        "moe_router_without_te",
    ],
)


def launch(scenarios, without, ranks):
    """Run scenarios in one fresh launch with ``without`` left out at first; return the RESULT json."""
    arguments = [str(HERE / "_scenarios.py"), *scenarios, "--without", ",".join(without)]
    if ranks == 1:
        command = [sys.executable, *arguments]
    else:
        command = [*torchrun(ranks), *arguments]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    process = run_ranks(command, timeout=LAUNCH_TIMEOUT - 20, env=env, cwd=HERE)
    lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    output = process.stdout + process.stderr
    assert process.returncode == 0 and lines, f"{scenarios} failed (exit {process.returncode}):\n{output[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def single_process():
    return launch(*SINGLE_PROCESS, ranks=1)


@pytest.fixture(scope="module")
def two_ranks():
    return launch(*TWO_RANKS, ranks=2)


def assert_failed_without(result, names):
    """Each named redirect, left out, failed as EXPECTED_FAILURES says."""
    for name in names:
        assert name in result["failures"], f"{name} never failed: {result['failures']}"
        failure = result["failures"][name]
        text = failure["error"] + " @ " + failure["where"]
        for substring in EXPECTED_FAILURES[name]:
            assert substring in text, f"{name}: expected {substring!r} in {text!r}"


def test_every_redirect_is_left_out_in_one_launch():
    left_out = SINGLE_PROCESS[1] + TWO_RANKS[1]
    assert sorted(left_out) == sorted(redirect_names()) == sorted(EXPECTED_FAILURES)


@pytest.mark.distributed
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_tp1_forward_backward_against_plain_torch_and_rng_tracker(single_process):
    assert_failed_without(single_process, ["rng_tracker", "current_device", "cuda_device_literals"])
    (rank,) = single_process["ranks"]
    tp1 = rank["tp1"]
    assert tp1["logits_shape"] == [2, 16, 128]
    assert tp1["logits_diff"] < 1e-5 and tp1["loss_diff"] < 1e-5 and tp1["grad_diff"] < 1e-6
    assert tp1["tracker_draws_match"] and tp1["default_generator_restored"]
    assert tp1["dropout_passes_differ"] and tp1["dropout_reseed_repeats"]
    assert "not divisible by tp*pp*cp" in tp1["bad_sizes_error"]


@pytest.mark.heavy  # starts a process
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_mla_and_the_compiled_router_bias_update_run_on_cpu(single_process):
    assert_failed_without(single_process, ["mla_without_te"])
    (rank,) = single_process["ranks"]
    mla = rank["mla"]
    assert mla["logits_shape"] == [2, 24, 512] and mla["finite"] and mla["grads"]
    assert mla["tokens_counted"] == [2 * 24 * 4] * 2  # the compiled expert-bias update ran in both MoE layers
    assert mla["synchronize_is_its_own"]


@pytest.mark.distributed
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_megatron_optimizer_matches_torch_adam_with_clipping(single_process):
    assert_failed_without(single_process, ["cuda_type_names"])
    (rank,) = single_process["ranks"]
    for kind in ("plain", "distributed"):
        numbers = rank["optimizer"][kind]
        assert numbers["grad_norms"] == pytest.approx(numbers["reference_grad_norms"], rel=1e-6)
        assert min(numbers["reference_grad_norms"]) > 0.05  # the clip (max norm 0.05) was active
        assert numbers["param_diff"] < 1e-5, (kind, numbers)


@pytest.mark.distributed
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_selective_recompute_of_norms_and_mlp_keeps_the_gradients(single_process):
    assert_failed_without(single_process, ["checkpoint_without_output_fp8"])
    (rank,) = single_process["ranks"]
    assert rank["selective_recompute"]["grad_diff"] <= 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_grouped_gemm_experts_match_sequential_experts(single_process):
    """moe_grouped_gemm=True on CPU: megatron's GroupedMLP over the stand-in gmm, fp32, the same logits (bit for
    bit, measured) and gradients as SequentialMLP with the same weights."""
    assert_failed_without(single_process, ["grouped_gemm"])
    (rank,) = single_process["ranks"]
    grouped = rank["grouped_gemm"]
    assert grouped["expert_params"] == ["weight1", "weight1", "weight2", "weight2"]  # GroupedMLP in both layers
    assert grouped["logits_diff"] <= 1e-6 and grouped["grad_diff"] <= 1e-6, grouped


@pytest.mark.distributed
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_tp2_with_and_without_sequence_parallel_matches_tp1(two_ranks):
    assert_failed_without(two_ranks, ["sequence_parallel_norm"])
    for rank in two_ranks["ranks"]:
        for mode in ("no_sp", "sp"):
            numbers = rank["tp2"][mode]
            assert numbers["weight_diff"] == 0.0, (mode, numbers)  # same master weights: same seed, CPU init
            assert numbers["logits_diff"] < 1e-5, (mode, numbers)
            assert numbers["grad_diff"] < 1e-6, (mode, numbers)
        # With SP each rank's norm grads cover half the sequence; the redirect's tag makes finalize sum them.
        sp = rank["tp2"]["sp"]
        assert sp["norm_params_tagged"]
        assert sp["norm_grad_diff_before_finalize"] > 1e-3
        assert sp["norm_grad_diff"] < 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_pp2_1f1b_matches_pp1(two_ranks):
    assert_failed_without(two_ranks, ["tensor_cuda_method", "synchronize"])
    first, last = sorted((rank["pp2"] for rank in two_ranks["ranks"]), key=lambda stage: stage["stage"])
    assert first["losses"] == []  # only the last stage computes the loss
    assert len(last["losses"]) == 4
    assert last["losses"] == pytest.approx(last["reference_losses"], abs=1e-6)
    for stage in (first, last):
        assert stage["layer_grad_diff"] < 1e-6
        assert stage["tied_embedding_grad_diff"] < 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_moe_alltoall_ep2_matches_ep1(two_ranks):
    assert_failed_without(two_ranks, ["streams", "moe_split_sizes_numpy", "moe_router_without_te"])
    for rank in two_ranks["ranks"]:
        assert rank["moe_ep2"]["logits_diff"] < 1e-5 and rank["moe_ep2"]["grad_diff"] < 1e-6, rank["moe_ep2"]
