"""Benchmark: long sequences in the Megatron engine, packed against padded, CP2 against CP1.

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_context.py [--samples 16] [--median 192] [--iters 3]
                                                             [--budget-gb 1.0]

fp32 on CPU, a tiny Qwen2 of the ``small`` fixture size (hidden 256, 4 layers, 8 heads, 4 KV heads),
one actor update (forward, PPO loss, backward, Adam step) per timed iteration, median of ``--iters``
after a warm-up; peak activations are the most bytes autograd holds for backward at once (saved-
tensor hooks, once per storage, weights excluded: tests/engine/_memory_worker.py's counter).

1. **Packed against padded** (one process): ``--samples`` sequences of a 32-token prompt and a
   response whose lengths are the quantiles of a log-normal with the longest 8 x the median
   (``--median``), in a shuffled order. The same batch runs packed (``use_remove_padding=True``)
   and padded, with fixed micro-batches of 4 samples and with a token budget (``use_dynamic_bsz``,
   the longest sample x 2 per micro-batch). Tokens/s counts real tokens. Target: packed >= 1.5 x
   padded tokens/s.
2. **CP2 against CP1** (torchrun, 1 and 2 processes): one sequence as long as the planner says
   fits ``--budget-gb`` of activations on one rank (``megarl.plan.activations``; a stand-in for a
   GPU's memory limit that keeps the run short on 2 cores), its peak activations per rank and
   tokens/s. Target: CP2 peak <= 0.6 x CP1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
PROMPT = 32


def long_tailed_lengths(samples: int, median: int) -> list[int]:
    """Response lengths at the log-normal's quantiles (i + 0.5) / n, scaled so the longest is 8 x the median."""
    normal = torch.distributions.Normal(0.0, 1.0)
    z = [float(normal.icdf(torch.tensor((i + 0.5) / samples))) for i in range(samples)]
    sigma = math.log(8) / (max(z) - statistics.median(z))
    lengths = [max(1, round(median * math.exp(sigma * (q - statistics.median(z))))) for q in z]
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(0)).tolist()
    return [lengths[i] for i in order]


def make_batch(response_lengths: list[int], vocab: int):
    from megarl.engine import RLBatch

    generator = torch.Generator().manual_seed(1)
    width = max(response_lengths)
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(response_lengths).unsqueeze(1)).long()
    responses = torch.randint(3, vocab, mask.shape, generator=generator) * mask
    prompts = torch.randint(3, vocab, (len(response_lengths), PROMPT), generator=generator)
    batch = RLBatch.from_parts(prompts, torch.ones_like(prompts), responses, mask,
                               advantages=torch.randn(mask.shape, generator=generator) * mask)
    return batch.with_fields(old_log_probs=torch.full(mask.shape, -6.0) * mask)


def settings(packed: bool, micro_batch_size: int | None, max_token_len: int = 0):
    from megarl.engine import ActorSettings, BatchSettings, OptimizerSettings

    train = BatchSettings(micro_batch_size=micro_batch_size, use_dynamic_bsz=micro_batch_size is None,
                          max_token_len=max_token_len or 1, use_remove_padding=packed)
    return ActorSettings(train=train, log_prob=train, optim=OptimizerSettings(lr=1e-5, weight_decay=0.0))


def measure(actor, batch, iters: int) -> tuple[float, int]:
    """(median seconds of one update, peak saved activation bytes of the first timed one)."""
    from _memory_worker import SavedActivations

    actor.update_policy(batch)  # warm-up
    times, peak = [], 0
    for i in range(iters):
        counter = SavedActivations(p for chunk in actor.model for p in chunk.parameters())
        start = time.perf_counter()
        if i == 0:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                actor.update_policy(batch)
            peak = counter.peak
        else:
            actor.update_policy(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:] or times), peak


def packed_against_padded(checkpoint: Path, args) -> None:
    from megarl.engine import MegatronActor
    from megarl.models import ParallelLayout, build_model
    from megarl.platform import init_distributed, initialize_model_parallel

    init_distributed()
    initialize_model_parallel(seed=0)
    lengths = long_tailed_lengths(args.samples, args.median)
    batch = make_batch(lengths, 512)
    tokens = int(batch.attention_mask.sum())
    print(f"1. packed vs padded: {args.samples} samples, responses {min(lengths)}..{max(lengths)} tokens (median "
          f"{int(statistics.median(lengths))}, longest {max(lengths) / statistics.median(lengths):.1f}x it) after "
          f"{PROMPT}-token prompts: {tokens} real tokens")
    budget = 2 * (PROMPT + max(lengths))
    for split, micro, max_tokens in (("micro-batches of 4", 4, 0), (f"token budget {budget}", None, budget)):
        result = {}
        for packed in (False, True):
            actor = MegatronActor(build_model(checkpoint, ParallelLayout(), "actor"), settings(packed, micro, max_tokens))
            seconds, peak = measure(actor, batch, args.iters)
            result[packed] = (tokens / seconds, peak)
            name = "packed" if packed else "padded"
            print(f"   {split:22} {name}: {tokens / seconds:8.0f} tok/s ({seconds:.2f} s), peak activations "
                  f"{peak / 2**20:7.1f} MiB")
        print(f"   {split:22} ratio packed / padded: tokens/s {result[True][0] / result[False][0]:.2f} (target >= 1.5), "
              f"peak activations {result[True][1] / result[False][1]:.2f}")


def cp_worker(checkpoint: Path, length: int, iters: int, out: Path) -> None:
    """One sequence of ``length`` tokens under CP = world size; rank 0 writes its numbers."""
    import torch.distributed as dist

    from megarl.engine import MegatronActor
    from megarl.models import ParallelLayout, build_model
    from megarl.platform import init_distributed, initialize_model_parallel

    init_distributed()
    cp = dist.get_world_size()
    initialize_model_parallel(cp=cp, seed=0)
    batch = make_batch([length - PROMPT], 512)
    actor = MegatronActor(build_model(checkpoint, ParallelLayout(cp=cp), "actor"), settings(True, 1))
    seconds, peak = measure(actor, batch, iters)
    peaks = [None] * cp
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"seconds": seconds, "peak": max(peaks), "tokens": length}))
    dist.destroy_process_group()


def planned_length(checkpoint: Path, budget: int) -> int:
    """The longest single sequence (a multiple of 256) whose planned CP1 activations fit ``budget`` bytes."""
    from megarl.models import ParallelLayout, load_hf_config
    from megarl.plan.activations import MicroBatch, Recompute
    from megarl.plan.memory import activation_bytes
    from megarl.plan.model import ModelFacts

    model = ModelFacts(load_hf_config(checkpoint))
    length = 256
    while True:
        mb = MicroBatch(1, length + 256, length + 256 - PROMPT)
        saved, _ = activation_bytes(model, ParallelLayout(), 0, mb, 1, Recompute(), False, False, 4, "local")
        if saved > budget:
            return length
        length += 256


def cp_against_cp1(checkpoint: Path, args) -> None:
    length = planned_length(checkpoint, int(args.budget_gb * 2**30))
    print(f"2. CP2 vs CP1: one sequence of {length} tokens (the longest whose planned activations fit "
          f"{args.budget_gb:g} GiB on one rank)")
    result = {}
    for cp in (1, 2):
        out = Path(tempfile.mkdtemp()) / "cp.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), __file__,
                   "--worker", str(checkpoint), str(length), str(args.iters), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"CP{cp} worker failed:\n{done.stderr[-4000:]}")
        result[cp] = json.loads(out.read_text())
        r = result[cp]
        print(f"   CP{cp}: {r['tokens'] / r['seconds']:8.0f} tok/s ({r['seconds']:.2f} s), peak activations per rank "
              f"{r['peak'] / 2**20:7.1f} MiB")
    print(f"   ratio CP2 / CP1: peak activations per rank {result[2]['peak'] / result[1]['peak']:.2f} (target <= 0.6), "
          f"tokens/s {result[1]['seconds'] / result[2]['seconds']:.2f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, checkpoint, length, iters, out = sys.argv
        cp_worker(Path(checkpoint), int(length), int(iters), Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--median", type=int, default=192)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--budget-gb", type=float, default=1.0)
    args = parser.parse_args()

    from megarl.tools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = make_tiny_model("qwen2", "small", Path(directory) / "model", seed=0)
        print(f"model qwen2/small (hidden 256, 4 layers), fp32, {torch.get_num_threads()} thread(s)")
        packed_against_padded(checkpoint, args)
        cp_against_cp1(checkpoint, args)


if __name__ == "__main__":
    main()
