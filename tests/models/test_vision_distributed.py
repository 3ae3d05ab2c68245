"""Qwen2.5-VL and Qwen3-VL at TP=2, TP=2 + SP and PP=2: one torchrun launch, 2 ranks (``_vision_worker.py``).

The batch holds images of different sizes and text-only rows. Logits within 1e-5 of transformers' (fp32) on
every rank's vocabulary slice; the vision tower on both TP ranks, on the first pipeline stage only; under
sequence parallelism its gradients equal HF's on both TP ranks; the export gives back the checkpoint
(language model and vision tower) bit for bit.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("_vision_worker.py")
TOLERANCE = 1e-5
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
SCENARIOS = [f"{family}/{layout}" for family in FAMILIES for layout in ("tp2", "tp2_sp", "pp2")]


@pytest.fixture(scope="module")
def results(vision_zoo):
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER), str(vision_zoo)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    records = json.loads((vision_zoo / "vision_results.json").read_text())
    return {(r["scenario"], r["rank"]): r for r in records}


def _records(results, scenario):
    found = [results[(scenario, rank)] for rank in (0, 1)]
    for record in found:
        assert "error" not in record, f"{scenario} rank {record['rank']}:\n{record['error']}"
    return found


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_logits_match_hugging_face(results, scenario):
    records = [r for r in _records(results, scenario) if "max_diff" in r]
    assert len(records) == (1 if scenario.endswith("pp2") else 2)
    for record in records:
        assert record["max_diff"] <= TOLERANCE, f"{scenario} rank {record['rank']}: max |megatron - HF| = {record['max_diff']}"


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_is_replicated_over_tp_and_on_the_first_stage_only(results, family):
    tp = _records(results, f"{family}/tp2")
    assert tp[0]["tower_tensors"] == tp[1]["tower_tensors"] > 0
    stages = {r["pp_rank"]: r["tower_tensors"] for r in _records(results, f"{family}/pp2")}
    assert stages == {0: tp[0]["tower_tensors"], 1: 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_gradients_match_hugging_face_under_sequence_parallelism(results, family):
    for record in _records(results, f"{family}/tp2_sp"):
        assert record["tower_grad_error"] <= 1e-4, f"rank {record['rank']}: {record['tower_grad_error']}"


@pytest.mark.parametrize("scenario", [f"{family}/{layout}" for family in FAMILIES for layout in ("tp2", "pp2")])
def test_export_reproduces_the_checkpoint_bit_for_bit(results, scenario):
    assert _records(results, scenario)[0]["export"] == {"missing": [], "extra": [], "mismatched": []}
