"""Bridge scenarios under torchrun (2 ranks, gloo); run by tests/models/test_bridge_distributed.py.

    torchrun --nproc-per-node 2 _dist_worker.py WORK_DIR

WORK_DIR holds the checkpoints and ``reference.pt`` (HF logits/values computed by the test
process with transformers). For each scenario (family x layout) every rank builds the megatron
model from the checkpoint, runs a forward through megatron's forward_backward_func
(forward_only), and records the max |megatron - HF| over its vocab slice; some scenarios also
gather the export on rank 0 and compare it with the original safetensors bit for bit, or
record which files and how many elements the loader read. Rank 0 writes ``results.json``.
This script measures; the test asserts.
"""
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from megarl import platform
from megarl.models import ParallelLayout, build_model, gather_hf_tensors, save_hf_checkpoint
from megarl.models import loading

from tests.models.two_ranks import recorded, write_records

MOE = {"qwen3_moe", "mixtral"}
SCENARIOS = []  # (name, checkpoint, layout, role, extra)
for family in ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]:
    SCENARIOS.append((f"{family}/tp2", family, ParallelLayout(tp=2), "actor", {"export": True}))
    SCENARIOS.append((f"{family}/tp2_sp", family, ParallelLayout(tp=2, sequence_parallel=True), "actor", {}))
    SCENARIOS.append((f"{family}/pp2", family, ParallelLayout(pp=2), "actor", {"export": True}))
    if family in MOE:
        SCENARIOS.append((f"{family}/ep2", family, ParallelLayout(ep=2), "actor", {"export": True}))
        SCENARIOS.append((f"{family}/tp2_ep2_sp", family, ParallelLayout(tp=2, ep=2, sequence_parallel=True), "actor", {}))
SCENARIOS += [
    ("mixtral/ep2_allgather", "mixtral", ParallelLayout(ep=2), "actor", {"dispatcher": "allgather"}),
    ("mixtral/tp2_etp2", "mixtral", ParallelLayout(tp=2, etp=2), "actor", {"export": True}),
    ("llama_tied/tp2", "llama_tied", ParallelLayout(tp=2), "actor", {"export": True}),
    ("llama_tied/pp2", "llama_tied", ParallelLayout(pp=2), "actor", {"export": True}),
    ("llama_small/pp2_vpp2", "llama_small", ParallelLayout(pp=2, vpp=2), "actor", {"export": True}),
    ("llama_sharded/pp2", "llama_sharded", ParallelLayout(pp=2), "actor", {"record_reads": True, "save": True}),
    ("llama_sharded/tp2", "llama_sharded", ParallelLayout(tp=2), "actor", {"record_reads": True}),
    ("llama_critic/tp2_sp", "llama_critic", ParallelLayout(tp=2, sequence_parallel=True), "critic", {"export": True}),
    ("llama_critic/pp2", "llama_critic", ParallelLayout(pp=2), "critic", {}),
    ("llama_vocab504/tp2", "llama_vocab504", ParallelLayout(tp=2), "actor", {"export": True}),
    ("llama_vocab504/tp2_sp", "llama_vocab504", ParallelLayout(tp=2, sequence_parallel=True), "actor", {}),
]
# DeepSeek-V3 (3 layers: dense, MoE, MoE): TP (megatron needs SP with MoE at TP > 1), uneven PP, EP, expert-TP.
DEEPSEEK_V3 = {
    "tp2_sp": (ParallelLayout(tp=2, sequence_parallel=True), {"export": True}),
    "pp2_1_2": (ParallelLayout(pp=2, first_stage_layers=1, last_stage_layers=2), {"export": True, "record_reads": True}),
    "pp2_2_1": (ParallelLayout(pp=2, first_stage_layers=2), {"record_reads": True}),
    "ep2": (ParallelLayout(ep=2), {"export": True}),
    "ep2_allgather": (ParallelLayout(ep=2), {"dispatcher": "allgather"}),
    "tp2_ep2_sp": (ParallelLayout(tp=2, ep=2, sequence_parallel=True), {}),
    "tp2_etp2_sp": (ParallelLayout(tp=2, etp=2, sequence_parallel=True), {"export": True}),
}
SCENARIOS += [(f"deepseek_v3/{name}", "deepseek_v3", layout, "actor", extra) for name, (layout, extra) in DEEPSEEK_V3.items()]
# Gemma-2 / Gemma-3 (2 layers: sliding, then global): TP with and without SP, PP splitting the two layer kinds.
for family in ["gemma2", "gemma3"]:
    SCENARIOS.append((f"{family}/tp2", family, ParallelLayout(tp=2), "actor", {"export": True}))
    SCENARIOS.append((f"{family}/tp2_sp", family, ParallelLayout(tp=2, sequence_parallel=True), "actor", {}))
    SCENARIOS.append((f"{family}/pp2", family, ParallelLayout(pp=2), "actor", {"export": True}))
# GLM-4.5 (2 layers: dense, MoE): TP (with SP, as megatron needs with MoE), PP, EP, TP x EP.
GLM4_MOE = {
    "tp2_sp": (ParallelLayout(tp=2, sequence_parallel=True), {"export": True}),
    "pp2": (ParallelLayout(pp=2), {"export": True}),
    "ep2": (ParallelLayout(ep=2), {"export": True}),
    "ep2_allgather": (ParallelLayout(ep=2), {"dispatcher": "allgather"}),
    "tp2_ep2_sp": (ParallelLayout(tp=2, ep=2, sequence_parallel=True), {}),
}
SCENARIOS += [(f"glm4_moe/{name}", "glm4_moe", layout, "actor", extra) for name, (layout, extra) in GLM4_MOE.items()]
# Kimi-K2 is deepseek_v3's bridge: two layouts show its model type reaches it on every rank.
SCENARIOS += [("kimi_k2/tp2_sp", "kimi_k2", ParallelLayout(tp=2, sequence_parallel=True), "actor", {"export": True}),
              ("kimi_k2/ep2", "kimi_k2", ParallelLayout(ep=2), "actor", {"export": True})]
# gpt-oss (2 layers: sliding, full): sinks split with the heads over TP, the sliding layer on its own PP stage,
# the packed experts split over EP and packed back by the export.
SCENARIOS += [("gpt_oss/tp2_sp", "gpt_oss", ParallelLayout(tp=2, sequence_parallel=True), "actor", {"export": True}),
              ("gpt_oss/pp2", "gpt_oss", ParallelLayout(pp=2), "actor", {"export": True}),
              ("gpt_oss/ep2", "gpt_oss", ParallelLayout(ep=2), "actor", {"export": True})]
# Qwen3-Next (4 layers: linear, full | linear, linear): TP splits the DeltaNet by key heads, PP the hybrid pattern, EP its experts.
SCENARIOS += [("qwen3_next/tp2", "qwen3_next", ParallelLayout(tp=2), "actor", {"export": True}),
              ("qwen3_next/tp2_sp", "qwen3_next", ParallelLayout(tp=2, sequence_parallel=True), "actor", {}),
              ("qwen3_next/pp2", "qwen3_next", ParallelLayout(pp=2), "actor", {"export": True}),
              ("qwen3_next/ep2", "qwen3_next", ParallelLayout(ep=2), "actor", {"export": True})]
# Qwen3.5 (Qwen3-Next's 4 hybrid layers, unfused DeltaNet projections): PP2 for the dense and the MoE model, EP2 for the MoE.
# the gated DeltaNet under TP: gradients at TP=1, TP=2 and TP=2+SP by HF name (grads_<scenario>.pt), and a TP=2
# distributed checkpoint of changed weights loaded at TP=1 (dist_ckpt_<family>, expected_<family>.pt)
for family in ("qwen3_next", "qwen3_5"):
    SCENARIOS += [(f"{family}/tp1_grads", family, ParallelLayout(), "actor", {"grads": True}),
                  (f"{family}/tp2_grads_save", family, ParallelLayout(tp=2), "actor", {"grads": True, "save_dist": True}),
                  (f"{family}/tp2_sp_grads", family, ParallelLayout(tp=2, sequence_parallel=True), "actor", {"grads": True}),
                  (f"{family}/tp1_load", family, ParallelLayout(), "actor", {"load_dist": True})]
SCENARIOS += [("qwen3_5/tp2_sp", "qwen3_5", ParallelLayout(tp=2, sequence_parallel=True), "actor", {"export": True}),
              ("qwen3_5/pp2", "qwen3_5", ParallelLayout(pp=2), "actor", {"export": True}),
              ("qwen3_5_moe/pp2", "qwen3_5_moe", ParallelLayout(pp=2), "actor", {"export": True}),
              ("qwen3_5_moe/ep2", "qwen3_5_moe", ParallelLayout(ep=2), "actor", {"export": True})]


class ReadRecorder:
    """Stands in for safetensors.safe_open in the loader: records files opened and elements read.

    Only ``get_slice`` is offered, so a whole-tensor read (``get_tensor``) would fail loudly.
    """

    def __init__(self, log):
        self.log = log

    def __call__(self, path, framework):
        log = self.log
        log["files"].append(Path(path).name)

        class Handle:
            def __enter__(self):
                self.inner = safe_open(path, framework=framework).__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):  # a single-file checkpoint's names (no index), read from its header
                return self.inner.keys()

            def get_slice(self, name):
                inner = self.inner.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return inner.get_shape()

                    def __getitem__(self, index):
                        values = inner[index]
                        log["elements"] += values.numel()
                        log["tensors"].append(name)
                        return values

                return Slice()

        return Handle()


def forward(models, layout, input_ids):
    """Logits (or values) of the last stage via megatron's schedule; None on other stages (the
    conversion's own runner: one micro-batch per sequence, as the interleaved schedule needs)."""
    from conversion.verify import megatron_logits

    return megatron_logits(models, input_ids)


def original_tensor(checkpoint, files: dict, name: str) -> torch.Tensor:
    """One tensor of the original checkpoint, read with safetensors; ``files`` is ``loading.checkpoint_files``'s map."""
    with safe_open(str(checkpoint / files[name]), framework="pt") as f:
        return f.get_tensor(name)


def compare_export(models, checkpoint, layout, role):
    """On rank 0: names and tensors of the gathered export vs the original safetensors, bit for bit
    (DeepSeek-V3's multi-token-prediction layer, which the bridge skips, left out)."""
    from megarl.models import family_for, load_hf_config

    config = load_hf_config(checkpoint)
    skipped = family_for(config).skipped_hf_tensors(config)
    original = {name: file for name, file in loading.checkpoint_files(checkpoint).items()
                if skipped is None or not skipped.search(name)}
    seen, mismatched = [], []
    for name, tensor in gather_hf_tensors(models, checkpoint, layout, role):
        seen.append(name)
        reference = original_tensor(checkpoint, original, name)
        if reference.dtype != tensor.dtype or not torch.equal(reference, tensor):
            mismatched.append(name)
    if dist.get_rank() != 0:
        return None
    return {"missing": sorted(set(original) - set(seen)), "extra": sorted(set(seen) - set(original)), "mismatched": mismatched}


def grads_and_checkpoints(models, checkpoint, layout, name, extra, work) -> dict:
    """``grads``: one backward of sum(logits^2) / its size, the gradients gathered by HF name to
    ``grads_<scenario>.pt``; ``save_dist``: the weights moved along them, gathered to ``expected_<family>.pt``
    and saved as a distributed checkpoint; ``load_dist``: that checkpoint loaded here, gathered and compared."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if not any(extra.get(key) for key in ("grads", "save_dist", "load_dist")):
        return {}
    [model], family, found = models, checkpoint.name, {}
    path = work / f"dist_ckpt_{family}"
    if extra.get("grads"):
        input_ids = torch.load(work / "reference.pt")[family]["input_ids"]
        logits = model(input_ids, torch.arange(input_ids.shape[1]).unsqueeze(0), None).float()
        ((logits ** 2).sum() / (logits.numel() * layout.tp)).backward()
        for n, p in model.named_parameters():  # the sums over ranks that training's DDP and finalize_model_grads do:
            if p.grad is None:
                continue
            if "q_layernorm" in n or "k_layernorm" in n or getattr(p, "sequence_parallel", False):  # over TP
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            elif layout.sequence_parallel and ".mlp.experts." in n:  # whole experts, each TP rank's tokens
                dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
        weights = {n: p.data for n, p in model.named_parameters()}
        for p in model.parameters():  # an expert no token reached has no gradient
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        grads = dict(gather_hf_tensors(models, checkpoint, layout, "actor"))
        for n, p in model.named_parameters():
            p.data = weights[n]
        if dist.get_rank() == 0:
            torch.save(grads, work / f"grads_{name.replace('/', '_')}.pt")
    if extra.get("save_dist"):
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=10.0)
        expected = dict(gather_hf_tensors(models, checkpoint, layout, "actor"))
        if dist.get_rank() == 0:
            torch.save(expected, work / f"expected_{family}.pt")
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(path))
    if extra.get("load_dist"):
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(path)))
        loaded = dict(gather_hf_tensors(models, checkpoint, layout, "actor"))
        if dist.get_rank() == 0:
            expected = torch.load(work / f"expected_{family}.pt")
            found["load_mismatched"] = sorted(n for n in expected if not torch.equal(expected[n], loaded.get(n)))
            files = loading.checkpoint_files(checkpoint)
            found["load_changed"] = sum(not torch.equal(t, original_tensor(checkpoint, files, n)) for n, t in loaded.items())
    return found


def run(name, checkpoint, layout, role, extra, work):
    from megatron.core import parallel_state as ps

    platform.initialize_model_parallel(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, vpp=layout.vpp if layout.vpp > 1 else None)
    record = {"scenario": name, "rank": dist.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank()}
    with recorded(record):
        reads = {"files": [], "elements": 0, "tensors": []}
        real_safe_open = loading.safe_open
        if extra.get("record_reads"):
            loading.safe_open = ReadRecorder(reads)
        try:
            models = build_model(work / checkpoint, layout, role, moe_token_dispatcher=extra.get("dispatcher", "alltoall"))
        finally:
            loading.safe_open = real_safe_open
        record["reads"] = reads
        reference = torch.load(work / "reference.pt")[checkpoint]
        output = forward(models, layout, reference["input_ids"])
        if output is not None:
            expected = reference["output"]
            if role == "actor":  # this rank's vocabulary slice; columns past the real vocabulary are padding
                vocab = output.shape[-1]
                start = ps.get_tensor_model_parallel_rank() * vocab
                expected = expected[..., start : start + vocab]
                real = expected.shape[-1]
                record["padding_columns"] = vocab - real
                record["padding_masked"] = bool(torch.all(output[..., real:] == float("-inf")))
                output = output[..., :real]
            record["max_diff"] = (output - expected).abs().max().item()
            record["output_shape"] = list(output.shape)
        if extra.get("export"):
            record["export"] = compare_export(models, work / checkpoint, layout, role)
        record.update(grads_and_checkpoints(models, work / checkpoint, layout, name, extra, work))
        if extra.get("save"):
            save_hf_checkpoint(models, work / checkpoint, layout, work / "saved" / name.replace("/", "_"), role, max_shard_bytes=300_000)
    return record


def main():
    work = Path(sys.argv[1])
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    platform.init_distributed(timeout_s=180)
    records = []
    for name, checkpoint, layout, role, extra in SCENARIOS:
        if only and name not in only:
            continue
        records.append(run(name, checkpoint, layout, role, extra, work))
        dist.barrier()
    write_records(records, work / "results.json")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
