"""Benchmark: LoRA against full fine-tuning on the Megatron engine (trainer memory, sync bytes).

    OMP_NUM_THREADS=1 .venv/bin/python bench/lora.py [--model smollm2] [--rank 16] [--alpha 32]

One process, one rank, fp32 on CPU. The same model (default SmolLM2-135M-Instruct from
``megarl.devtools.pretrained``; ``--model`` also takes an HF directory) is built as an actor twice:
full fine-tuning, and LoRA of ``--rank`` on every linear of every layer (``all-linear``). Each
actor takes one real training step (so the optimizer state exists), then its bytes are counted
from the engine's own tensors:

* parameters: every parameter of the model (LoRA: the frozen base + the adapters);
* gradients: megatron DDP's gradient buffers (allocated for trainable parameters only);
* optimizer state: the tensors of the (distributed) optimizer's state (Adam's moments, and fp32
  master copies where the parameters are not fp32).

Sync bytes per step: merged weights (``lora.merge=True``, and full fine-tuning) send every weight
of the model (``export_hf_pieces``, what the sharded sync reads); adapter-only updates
(``lora.merge=False``) send the adapter in PEFT format (``gather_adapter_tensors``).

Process peak memory: each of the two actors is built and trained in a process of its own (this
script, ``--only full`` / ``--only lora``), whose peak resident set (``ru_maxrss``) is reported
next to the tensor bytes: it adds what the tensors leave out (Python, torch and megatron, the
activations of the step, allocator slack), so its ratio is higher. Printed: the ratios (LoRA /
full) of tensor bytes, of process peaks and of sync bytes.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import torch


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def trainer_memory(actor) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds for ``actor``."""
    chunks = list(actor.model)
    params = tensor_bytes(p for chunk in chunks for p in chunk.parameters())
    grads = tensor_bytes(buffer.grad_data for chunk in chunks
                         for buffer in chunk.buffers + chunk.expert_parallel_buffers)
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    state = [t for o in optimizers for s in o.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    masters = [p for o in optimizers for group in getattr(o, "shard_fp32_from_float16_groups", []) for p in group]
    return {"parameters": params, "gradients": grads, "optimizer": tensor_bytes(state + masters)}


def make_batch(vocab: int, batch_size: int = 2, seq: int = 32):
    from megarl.engine import RLBatch

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (batch_size, seq // 2), generator=generator)
    responses = torch.randint(3, vocab, (batch_size, seq // 2), generator=generator)
    return RLBatch.from_parts(prompts, torch.ones_like(prompts), responses, torch.ones_like(responses),
                              advantages=torch.randn(batch_size, seq // 2, generator=generator))


def measure(model: Path, lora) -> dict[str, int]:
    from megarl.engine import ActorSettings, BatchSettings, MegatronActor, OptimizerSettings
    from megarl.models import ParallelLayout, build_model, default_transformer_impl, export_hf_pieces, load_hf_config
    from megarl.models.lora import LoRATransform
    from megarl.models.lora.peft import gather_adapter_tensors

    layout = ParallelLayout()
    transforms = [LoRATransform(lora)] if lora is not None else []
    settings = ActorSettings(train=BatchSettings(micro_batch_size=2), log_prob=BatchSettings(micro_batch_size=2),
                             optim=OptimizerSettings(lr=1e-5, weight_decay=0.0))
    actor = MegatronActor(build_model(model, layout, "actor", transforms=transforms), settings)
    batch = make_batch(load_hf_config(model).vocab_size)
    batch = batch.with_fields(old_log_probs=actor.compute_log_prob(batch)[0])
    actor.update_policy(batch)  # the optimizer state exists after a step
    result = trainer_memory(actor)
    chunks = [getattr(m, "module", m) for m in actor.model]
    impl = default_transformer_impl()
    result["merged_sync"] = sum(math.prod(p.tensor.shape) * p.tensor.dtype.itemsize  # merged views: lazy
                                for p in export_hf_pieces(chunks, model, layout, "actor", impl))
    if lora is not None:
        result["adapter_sync"] = sum(t.numel() * t.element_size()
                                     for _, t in gather_adapter_tensors(chunks, model, layout, lora, "actor", impl))
    del actor, chunks
    gc.collect()
    return result


def run_one(model: Path, args) -> dict[str, int]:
    """``measure`` in this process (a child of ``main``), with its peak resident set."""
    from megarl.models.lora import LoRASettings
    from megarl.platform import init_distributed, initialize_model_parallel

    torch.set_num_threads(1)
    init_distributed()
    initialize_model_parallel(seed=0)
    lora = LoRASettings(rank=args.rank, alpha=args.alpha, target_modules=("all-linear",)) if args.only == "lora" else None
    result = measure(model, lora)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return result


def child(model: Path, args, mode: str) -> dict[str, int]:
    command = [sys.executable, __file__, "--model", str(model), "--rank", str(args.rank), "--alpha", str(args.alpha),
               "--only", mode]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} measurement failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a megarl.devtools.pretrained name or an HF directory")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--only", choices=("full", "lora"), help=argparse.SUPPRESS)  # one measurement, as JSON
    args = parser.parse_args()

    model = Path(args.model)
    if not model.is_dir():
        from megarl.devtools.pretrained import pretrained_model

        model = pretrained_model(args.model)
    if args.only:
        print(json.dumps(run_one(model, args)))
        return
    full, lora = child(model, args, "full"), child(model, args, "lora")

    def mib(n: int) -> str:
        return f"{n / 2**20:9.1f} MiB"

    print(f"model {model.name}, one rank, fp32 on CPU; LoRA rank {args.rank} on all-linear")
    print(f"{'':18s}{'full fine-tuning':>18s}{'LoRA':>18s}")
    for part in ("parameters", "gradients", "optimizer"):
        print(f"{part:18s}{mib(full[part]):>18s}{mib(lora[part]):>18s}")
    total_full, total_lora = (sum(r[k] for k in ("parameters", "gradients", "optimizer")) for r in (full, lora))
    print(f"{'tensor total':18s}{mib(total_full):>18s}{mib(total_lora):>18s}")
    print(f"{'process peak':18s}{mib(full['peak_rss']):>18s}{mib(lora['peak_rss']):>18s}")
    print(f"sync per step: merged weights {mib(lora['merged_sync'])} (full fine-tuning {mib(full['merged_sync'])}), "
          f"adapter-only {mib(lora['adapter_sync'])}")
    print(f"ratio 1 (trainer tensor bytes, LoRA / full): {total_lora / total_full:.3f}")
    print(f"ratio 1b (process peak memory, LoRA / full): {lora['peak_rss'] / full['peak_rss']:.3f}")
    print(f"ratio 2 (sync bytes per step, adapter-only / merged): {lora['adapter_sync'] / lora['merged_sync']:.4f}")


if __name__ == "__main__":
    main()
