"""Context parallelism (CP=2) against CP=1 on the same ranks (torchrun, gloo): every sequence split
into 2 x CP chunks over the CP ranks, megarl's core attention all-gathering keys and values.

Two launches (``_cp_worker.py``): ``cp2`` on 2 ranks (dense, a token budget, LoRA adapters, MoE with
EP2, the critic and the reference, replicas in export and checkpoints) and ``cp2_mp`` on 4 ranks (CP2 with TP2 and
sequence parallelism, with PP2, and with PP2 x VPP2). The batches' samples have 3 to 12 tokens, most
of them not a multiple of 2 x CP. Everything must equal the CP=1 run within 1e-5 (fp32).
"""
import pytest
import torch

import _engine_data as _data
import _engine_hf as _hf_reference
from _engine_launch import run_worker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOLERANCE = 1e-5
CP2 = ["dense", "dynamic", "lora", "moe_ep2"]
CP2_MP = ["tp2", "pp2", "pp2_vpp2"]
WORKER = __import__("pathlib").Path(__file__).with_name("_cp_worker.py")


@pytest.fixture(scope="module")
def cp2(engine_work):
    return run_worker(engine_work, "cp2", processes=2, timeout=500, worker=WORKER)


@pytest.fixture(scope="module")
def cp2_mp(engine_work):
    return run_worker(engine_work, "cp2_mp", processes=4, timeout=580, worker=WORKER)


def max_diff(a: dict, b: dict) -> float:
    assert a and a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def assert_equal_runs(result: dict) -> None:
    ours, theirs = result["cp"], result["cp1"]
    local, whole = ours["tokens"]
    assert local * 2 == whole and theirs["tokens"][0] == theirs["tokens"][1]  # each CP rank runs half a micro-batch
    assert (ours["log_probs"] - theirs["log_probs"]).abs().max() <= TOLERANCE
    assert (ours["entropy"] - theirs["entropy"]).abs().max() <= TOLERANCE
    assert result["grad_size"] > 0 and result["grad_diff"] <= TOLERANCE
    for metric in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert ours["metrics"][metric] == pytest.approx(theirs["metrics"][metric], rel=1e-5, abs=1e-7), metric
    assert max_diff(ours["weights"], theirs["weights"]) <= TOLERANCE


def test_the_batches_have_lengths_that_do_not_split_into_cp_chunks(data):
    lengths = data["batches"][_data.DENSE].sequence_lengths()
    assert (lengths % 4 != 0).sum() >= len(lengths) // 2


@pytest.mark.parametrize("case", CP2)
def test_cp2_equals_cp1(cp2, case):
    assert_equal_runs(cp2[case])


@pytest.mark.parametrize("case", CP2_MP)
def test_cp2_with_tensor_and_pipeline_parallelism_equals_cp1(cp2_mp, case):
    assert_equal_runs(cp2_mp[case])


def test_cp2_log_probs_match_hugging_face(cp2, engine_work, data):
    log_probs, entropy = _hf_reference.hf_log_probs(engine_work / _data.DENSE, data["batches"][_data.DENSE])
    assert (cp2["dense"]["cp"]["log_probs"] - log_probs).abs().max() <= TOLERANCE
    assert (cp2["dense"]["cp"]["entropy"] - entropy).abs().max() <= TOLERANCE


def test_critic_values_and_update_and_reference_log_probs_at_cp2(cp2):
    roles = cp2["roles"]
    assert roles["cp"]["values"].abs().sum() > 0
    assert (roles["cp"]["values"] - roles["cp1"]["values"]).abs().max() <= TOLERANCE
    assert (roles["cp"]["ref"] - roles["cp1"]["ref"]).abs().max() <= TOLERANCE
    ours, theirs = roles["cp"]["critic_update"], roles["cp1"]["critic_update"]
    for metric in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert ours[metric] == pytest.approx(theirs[metric], rel=1e-5, abs=1e-7), metric


def test_cp_ranks_hold_replicas_for_export_and_checkpoints(cp2, engine_work):
    """Over both CP ranks the exporter (what the weight sync and the HF export send) yields every
    element of every HF tensor exactly once; a checkpoint saved at CP2 loads at CP1 bit for bit."""
    from megarl.models import hf_tensor_shapes

    replicas = cp2["replicas"]
    counts = {name: torch.zeros(shape, dtype=torch.long) for name, shape in hf_tensor_shapes(engine_work / _data.DENSE).items()}
    for rank_pieces in replicas["pieces"]:
        for name, box in rank_pieces:
            counts[name][tuple(slice(a, b) for a, b in box)] += 1
    assert all(bool(c.eq(1).all()) for c in counts.values())
    assert max_diff(replicas["loaded"], replicas["saved"]) == 0.0
