"""Grouped-GEMM experts against SequentialMLP under torchrun (2 ranks, gloo), for test_grouped_experts_distributed.py.

    torchrun --nproc-per-node 2 _grouped_worker.py WORK_DIR

WORK_DIR holds the tiny Qwen3-MoE checkpoint (``qwen3_moe``). For each layout every rank builds the model twice
from it, SequentialMLP and ``moe_grouped_gemm=True`` (megatron's GroupedMLP over the CPU stand-in of
``grouped_gemm``), and records: the max |difference| of their logits (this rank's vocabulary slice) and of their
gradients (grouped experts read per expert, ``megarl.models.grouped_experts``); whether the grouped export equals
the checkpoint bit for bit; whether every weight-sync bucket this rank sends (a plan into a TP=2 engine) has the
same bytes. With ``resume`` it also trains: a SequentialMLP actor takes a step and saves a distributed checkpoint
(model and optimizer), a grouped actor resumes from it and takes the next step, and the weights after it are
compared with the SequentialMLP actor's own next step (and the same the other way round). Rank 0 writes
``grouped_results.json``. This script measures; the test asserts.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
import _engine_data as engine_data  # noqa: E402

from megarl import platform  # noqa: E402
from megarl.engine import MegatronActor, load_checkpoint, save_checkpoint  # noqa: E402
from megarl.engine.batch import data_parallel_shard  # noqa: E402
from megarl.models import ParallelLayout, build_model, export_hf_pieces, gather_hf_tensors  # noqa: E402
from megarl.models.grouped_experts import bridge_tensors  # noqa: E402
from tests.models.two_ranks import recorded, write_records  # noqa: E402

CHECKPOINT = "qwen3_moe"
SCENARIOS = {
    "tp2_sp": (ParallelLayout(tp=2, sequence_parallel=True), False),  # experts whole on each TP rank
    "ep2": (ParallelLayout(ep=2), True),  # half the experts per rank, dense weights data-parallel
    # expert-TP: each rank holds its slice of every expert's gate and of its up (fused per expert), and of down
    "tp2_etp2_sp": (ParallelLayout(tp=2, etp=2, sequence_parallel=True), True),
}
def _grads(model) -> dict:
    """Gradients by the bridge's names: a grouped expert's per-expert views of weight1 / weight2's gradient."""
    return bridge_tensors(model, of=lambda param: param.grad)


def _forward_backward(checkpoint, layout, grouped):
    [model] = build_model(checkpoint, layout, config_overrides={"moe_grouped_gemm": grouped})
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids, torch.arange(16).unsqueeze(0), None)
    (logits.float() ** 2).mean().backward()
    return model, logits.detach(), _grads(model)


def _export_mismatches(model, checkpoint, layout):
    """Names whose gathered export differs from the checkpoint (rank 0), or that are missing / extra."""
    original = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            original.update({name: f.get_tensor(name) for name in f.keys()})
    exported = dict(gather_hf_tensors([model], checkpoint, layout))
    if dist.get_rank() != 0:
        return None
    return sorted(set(original) ^ set(exported)) + [n for n, t in exported.items() if not torch.equal(t, original[n])]


def _sync_bytes(model, checkpoint, layout) -> list:
    """The bytes of every bucket this rank sends in a sync into one TP=2 engine (fp32), in plan order."""
    from megarl.weight_sync.layouts import plan_for_layouts
    from megarl.weight_sync.packing import pack_bucket
    from megarl.weight_sync.rollout_layout import RolloutLayout
    from megarl.weight_sync.sender import from_export, region_reader

    plan = plan_for_layouts(checkpoint, layout, 2, RolloutLayout(1, 2, "shard", first_rank=2), itemsize=4,
                            bucket_bytes=64 << 10)
    pieces = export_hf_pieces([model], checkpoint, layout, replicas=True)
    read = region_reader(from_export((p.hf_name, p.hf_slice, p.tensor) for p in pieces))
    return [pack_bucket(b, plan.meta, read, torch.empty(b.nbytes, dtype=torch.uint8)).clone()
            for b in plan.buckets if b.src == dist.get_rank()]


def _actor(checkpoint, layout, grouped):
    return MegatronActor(build_model(checkpoint, layout, config_overrides={"moe_grouped_gemm": grouped}),
                         engine_data.actor_settings())


def _on_policy(actor, batch):
    log_probs = actor.compute_log_prob(batch)[0]
    return batch.with_fields(old_log_probs=log_probs, ref_log_probs=log_probs)


def _resume_across(checkpoint, layout, work: Path, saved_grouped: bool) -> dict:
    """One step and a checkpoint with one expert module, the next step resumed with the other: the weights after
    it against the saver's own next step (max |difference|; HF-named, gathered on rank 0)."""
    from megatron.core import parallel_state as ps

    batch = data_parallel_shard(engine_data.base_batch(seed=3), ps.get_data_parallel_rank(),
                                ps.get_data_parallel_world_size())
    saver = _actor(checkpoint, layout, saved_grouped)
    saver.update_policy(_on_policy(saver, batch))
    root = work / f"ckpt_{'grouped' if saved_grouped else 'sequential'}_{layout.tp}{layout.ep}{layout.etp}"
    save_checkpoint(root, 1, saver.model, saver.optimizer, saver.scheduler)
    second = _on_policy(saver, batch)
    saver.update_policy(second)
    expected = dict(gather_hf_tensors(saver.model, checkpoint, layout))
    resumed = _actor(checkpoint, layout, not saved_grouped)
    load_checkpoint(root, resumed.model, resumed.optimizer, resumed.scheduler)
    resumed.update_policy(second)
    got = dict(gather_hf_tensors(resumed.model, checkpoint, layout))
    moved = dict(gather_hf_tensors(_actor(checkpoint, layout, False).model, checkpoint, layout))
    if dist.get_rank() != 0:
        return {}
    return {"weight_diff": max((got[n] - expected[n]).abs().max().item() for n in expected),
            "step_size": max((expected[n] - moved[n]).abs().max().item() for n in expected)}


def run(name, layout, resume, work):
    platform.initialize_model_parallel(tp=layout.tp, ep=layout.ep, etp=layout.etp)
    record = {"scenario": name, "rank": dist.get_rank()}
    with recorded(record):
        checkpoint = work / CHECKPOINT
        sequential, sequential_logits, sequential_grads = _forward_backward(checkpoint, layout, False)
        grouped, logits, grads = _forward_backward(checkpoint, layout, True)
        record["grouped_module"] = any(n.endswith("experts.weight1") for n, _ in grouped.named_parameters())
        record["logits_diff"] = (logits - sequential_logits).abs().max().item()
        record["same_grad_names"] = sorted(grads) == sorted(sequential_grads)
        record["grad_diff"] = max((grads[n] - sequential_grads[n]).abs().max().item() for n in grads)
        record["export_mismatches"] = _export_mismatches(grouped, checkpoint, layout)
        sent = [_sync_bytes(model, checkpoint, layout) for model in (sequential, grouped)]
        record["sync_buckets"] = len(sent[0])
        record["sync_bytes_equal"] = len(sent[0]) == len(sent[1]) and all(map(torch.equal, *sent))
        if resume:
            record["resume"] = {direction: _resume_across(checkpoint, layout, work, saved_grouped)
                                for direction, saved_grouped in (("sequential_to_grouped", False),
                                                                 ("grouped_to_sequential", True))}
    return record


def main():
    work = Path(sys.argv[1])
    platform.init_distributed(timeout_s=180)
    records = []
    for name, (layout, resume) in SCENARIOS.items():
        records.append(run(name, layout, resume, work))
        dist.barrier()
    write_records(records, work / "grouped_results.json")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
