"""Vision-language bridge scenarios under torchrun (2 ranks, gloo); run by tests/models/test_vision_distributed.py.

    torchrun --nproc-per-node 2 _vision_worker.py WORK_DIR

WORK_DIR holds ``vision_fixture``'s checkpoints and ``vision_reference.pt``. For Qwen2.5-VL and Qwen3-VL at
TP=2, TP=2 + SP and PP=2, and Qwen3-VL-MoE at TP=2 and EP=2, every rank builds the model, runs the batch (images of different sizes and text-only
rows) through megatron's forward_backward_func (forward only, one micro-batch) and records the max
|megatron - HF| over its vocabulary slice at the real tokens; at TP=2 + SP it also runs a backward of the sum
of the real tokens' logits and records the largest difference of the vision tower's gradients from HF's;
at TP=2, PP=2 and EP=2 rank 0 gathers the export and compares it with the checkpoint bit for bit. Rank 0 writes
``vision_results.json``. This script measures; the test asserts.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import platform
from megarl.models import ParallelLayout, build_model, model_dims
from megarl.models.mrope import mrope_position_ids
from tests.models._dist_worker import compare_export
from tests.models.two_ranks import recorded, write_records

LAYOUTS = {"tp2": ParallelLayout(tp=2), "tp2_sp": ParallelLayout(tp=2, sequence_parallel=True), "pp2": ParallelLayout(pp=2)}
SCENARIOS = [(f"{family}/{name}", family, layout) for family in ("qwen2_5_vl", "qwen3_vl") for name, layout in LAYOUTS.items()]
# Qwen3-VL-MoE: its experts split over TP, then whole over EP (2 experts a rank, the two ranks data-parallel)
SCENARIOS += [("qwen3_vl_moe/tp2", "qwen3_vl_moe", LAYOUTS["tp2"]), ("qwen3_vl_moe/ep2", "qwen3_vl_moe", ParallelLayout(ep=2))]


def padded_batch(reference: dict, checkpoint: Path, multiple: int) -> dict:
    """The batch right-padded to a multiple of ``multiple`` tokens, with its M-RoPE positions."""
    dims = model_dims(checkpoint)
    ids, mask = reference["input_ids"], reference["attention_mask"]
    extra = -ids.shape[1] % multiple
    ids = torch.nn.functional.pad(ids, (0, extra))
    mask = torch.nn.functional.pad(mask, (0, extra))
    positions = mrope_position_ids(ids, reference["image_grid_thw"], mask, image_token_id=dims.vision.image_token_id,
                                   spatial_merge_size=dims.vision.spatial_merge_size)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
            "pixel_values": reference["pixel_values"], "image_grid_thw": reference["image_grid_thw"]}


def call(model, batch):
    return model(batch["input_ids"], batch["position_ids"], None, pixel_values=batch["pixel_values"],
                 image_grid_thw=batch["image_grid_thw"])


def scheduled_logits(models, batch):
    """This rank's logits through megatron's pipeline schedule (last stage), else None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    outputs = []

    def forward_step(data_iterator, model):
        output = call(model, next(data_iterator))

        def collect(output_tensor):
            outputs.append(output_tensor.detach())
            return output_tensor.sum() * 0, {}

        return output, collect

    for model in models:
        model.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=models[0],
                                    num_microbatches=1, seq_length=batch["input_ids"].shape[1],
                                    micro_batch_size=batch["input_ids"].shape[0], forward_only=True)
    return outputs[0] if outputs else None


def tower_grad_error(model, batch, expected: dict) -> float:
    """max |grad - HF grad| / max |HF grad| over the tower's tensors, for the sum of the real tokens' logits
    (each TP rank sums its vocabulary slice; together they sum all of it)."""
    model.train()
    logits = call(model, batch)
    logits[batch["attention_mask"].bool()].sum().backward()
    worst = 0.0
    for name, param in model.visual.named_parameters():
        scale = expected[name].abs().max().item() or 1.0
        worst = max(worst, (param.grad - expected[name]).abs().max().item() / scale)
    return worst


def run(name, family, layout, work):
    from megatron.core import parallel_state as ps

    platform.initialize_model_parallel(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    record = {"scenario": name, "rank": dist.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
              "tp_rank": ps.get_tensor_model_parallel_rank()}
    with recorded(record):
        checkpoint = work / family
        reference = torch.load(work / "vision_reference.pt")[family]
        batch = padded_batch(reference, checkpoint, layout.tp)
        models = build_model(checkpoint, layout)
        record["tower_tensors"] = sum(1 for n, _ in models[0].named_parameters() if n.startswith("visual."))
        output = scheduled_logits(models, batch)
        if output is not None:
            vocab = output.shape[-1]
            start = record["tp_rank"] * vocab
            expected = reference["logits"][..., start:start + vocab]
            real = reference["attention_mask"].bool()
            record["max_diff"] = (output[:, :real.shape[1]] - expected)[real].abs().max().item()
        if layout.sequence_parallel:
            record["tower_grad_error"] = tower_grad_error(models[0], batch, reference["tower_grads"])
        if not layout.sequence_parallel:
            record["export"] = compare_export(models, checkpoint, layout, "actor")
    return record


def main():
    work = Path(sys.argv[1])
    platform.init_distributed(timeout_s=180)
    records = []
    for name, family, layout in SCENARIOS:
        records.append(run(name, family, layout, work))
        dist.barrier()
    write_records(records, work / "vision_results.json")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
