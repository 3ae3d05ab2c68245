"""SmolLM2-135M-Instruct through the bridge under torchrun (gloo); run by test_smollm2_bridge.py.

    torchrun --nproc-per-node 3 _bridge_worker.py MODEL_DIR WORK_DIR   # scenarios tp1 (3 DP copies), tp3
    torchrun --nproc-per-node 2 _bridge_worker.py MODEL_DIR WORK_DIR   # scenarios pp2, tp2 (refused)

WORK_DIR holds ``reference.pt`` (HF transformers logits, SDPA and eager attention, fp32, computed by the
test process). Each scenario builds the megatron model from the real checkpoint, runs a forward
through megatron's schedule, gathers the full vocab on the last stage and records the max
|megatron - HF| on rank 0; it also gathers the export on rank 0 and compares it with the
original safetensors bit for bit. Rank 0 writes ``results-<world>.json``. This script measures;
the test asserts.
"""
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from conversion.verify import full_vocab, megatron_logits
from megarl import platform
from megarl.models import ParallelLayout, build_model, gather_hf_tensors

SCENARIOS = {3: {"tp1": ParallelLayout(), "tp3": ParallelLayout(tp=3)},
             2: {"pp2": ParallelLayout(pp=2), "tp2": ParallelLayout(tp=2)}}


def export_mismatches(models, model_dir: Path, layout) -> list[str] | None:
    """On rank 0: the HF tensors whose export differs from the checkpoint (names, dtype or bits)."""
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as original:
        names = set(original.keys())
        seen, wrong = set(), []
        for name, tensor in gather_hf_tensors(models, model_dir, layout):
            seen.add(name)
            reference = original.get_tensor(name)
            if reference.dtype != tensor.dtype or not torch.equal(reference, tensor):
                wrong.append(name)
    if dist.get_rank() != 0:
        return None
    return wrong + [f"missing: {n}" for n in sorted(names - seen)] + [f"extra: {n}" for n in sorted(seen - names)]


def run(name, layout, model_dir: Path, work: Path) -> dict:
    from megatron.core import parallel_state as ps

    record = {"scenario": name, "rank": dist.get_rank()}
    started = time.perf_counter()
    try:
        platform.initialize_model_parallel(tp=layout.tp, pp=layout.pp)
        models = build_model(model_dir, layout, "actor", params_dtype=torch.float32)
        reference = torch.load(work / "reference.pt")
        logits = megatron_logits(models, reference["input_ids"])
        if logits is not None:
            logits = full_vocab(logits)
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                record["max_diff"] = (logits - reference["sdpa"]).abs().max().item()
                record["max_diff_eager"] = (logits - reference["eager"]).abs().max().item()
        record["export_mismatches"] = export_mismatches(models, model_dir, layout)
    except Exception as exc:  # recorded for the test to judge (the TP=2 refusal is expected here)
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    record["seconds"] = round(time.perf_counter() - started, 1)
    platform.destroy_model_parallel()
    return record


def main():
    model_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    platform.init_distributed(timeout_s=300)
    world = dist.get_world_size()
    records = []
    for name, layout in SCENARIOS[world].items():
        records.append(run(name, layout, model_dir, work))
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        (work / f"results-{world}.json").write_text(json.dumps([r for rank in gathered for r in rank], indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
