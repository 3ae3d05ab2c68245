"""Qwen2.5-VL and Qwen3-VL at TP=2, TP=2 + SP and PP=2, Qwen3-VL-MoE at TP=2 and EP=2: one torchrun launch, 2 ranks
(``_vision_worker.py``).

The batch holds images of different sizes and text-only rows. Logits within 1e-5 of transformers' (fp32) on
every rank's vocabulary slice; the vision tower on both TP ranks, on the first pipeline stage only; under
sequence parallelism its gradients equal HF's on both TP ranks; the export gives back the checkpoint
(language model and vision tower) bit for bit.
"""
from pathlib import Path

import pytest

from tests.models.two_ranks import rank_records, run_two_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("_vision_worker.py")
TOLERANCE = 1e-5
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
SCENARIOS = [f"{family}/{layout}" for family in FAMILIES for layout in ("tp2", "tp2_sp", "pp2")]
MOE_SCENARIOS = ["qwen3_vl_moe/tp2", "qwen3_vl_moe/ep2"]  # the packed experts split over TP, whole over EP


@pytest.fixture(scope="module")
def results(vision_zoo):
    return run_two_ranks(WORKER, vision_zoo, "vision_results.json", timeout=280)


@pytest.mark.parametrize("scenario", SCENARIOS + MOE_SCENARIOS)
def test_logits_match_hugging_face(results, scenario):
    records = [r for r in rank_records(results, scenario) if "max_diff" in r]
    assert len(records) == (1 if scenario.endswith("pp2") else 2)
    for record in records:
        assert record["max_diff"] <= TOLERANCE, f"{scenario} rank {record['rank']}: max |megatron - HF| = {record['max_diff']}"


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_is_replicated_over_tp_and_on_the_first_stage_only(results, family):
    tp = rank_records(results, f"{family}/tp2")
    assert tp[0]["tower_tensors"] == tp[1]["tower_tensors"] > 0
    stages = {r["pp_rank"]: r["tower_tensors"] for r in rank_records(results, f"{family}/pp2")}
    assert stages == {0: tp[0]["tower_tensors"], 1: 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_gradients_match_hugging_face_under_sequence_parallelism(results, family):
    for record in rank_records(results, f"{family}/tp2_sp"):
        assert record["tower_grad_error"] <= 1e-4, f"rank {record['rank']}: {record['tower_grad_error']}"


@pytest.mark.parametrize("scenario", [f"{family}/{layout}" for family in FAMILIES for layout in ("tp2", "pp2")]
                         + MOE_SCENARIOS)
def test_export_reproduces_the_checkpoint_bit_for_bit(results, scenario):
    assert rank_records(results, scenario)[0]["export"] == {"missing": [], "extra": [], "mismatched": []}
