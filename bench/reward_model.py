"""Benchmark: scoring with a reward model on a vLLM pooling engine against the Megatron engine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/reward_model.py [--family qwen2] [--size small] [--batch 128] [--rounds 5]

The two backends megarl could serve a discriminative reward model with, on the same tiny
``...ForSequenceClassification`` checkpoint and the same batch of variable-length sequences
(``--batch`` sequences of 32..``--max-len`` tokens), fp32, one CPU thread each:

* vLLM (``LLM(runner="pooling")``, ``classify`` with the raw head output), what
  ``megarl.rewards.reward_models`` runs;
* the Megatron engine: the bridge builds the checkpoint as a value-head model (``role="critic"``,
  the head loaded from ``score.weight``) and the engine's forward-only micro-batched runner
  (``ModelRunner.infer``, micro-batches of ``--micro-batch``) reads the output at the last token.

Rounds alternate which backend goes first; it prints each backend's scored tokens/s per round,
the median vLLM / Megatron ratio, and the largest score difference between the two (both must
be HF's: the tests check vLLM's against transformers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def sequences(batch: int, max_len: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, max_len + 1, (batch,), generator=generator).tolist()
    return [torch.randint(5, vocab, (n,), generator=generator).tolist() for n in lengths]


def megatron_scorer(path: Path, micro_batch: int):
    """A function scoring token lists with the bridge's value-head model on this process (TP=1)."""
    from megarl import platform
    from megarl.engine.batch import RLBatch
    from megarl.engine.runner import ModelRunner, response_values
    from megarl.engine.settings import BatchSettings
    from megarl.models import ParallelLayout, build_model

    platform.init_distributed()
    platform.initialize_model_parallel(tp=1, pp=1, ep=1, etp=1, seed=0)
    layout = ParallelLayout(tp=1, pp=1, ep=1, etp=1, vpp=1, sequence_parallel=False)
    runner = ModelRunner(build_model(str(path), layout, "critic"))
    settings = BatchSettings(micro_batch_size=micro_batch)

    def score(seqs: list[list[int]]) -> list[float]:
        # the whole sequence is the "prompt" (left-padded); one extra token is the "response",
        # whose value is read at the position before it: the output at the sequence's last token
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width + 1, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(seqs):
            ids[row, width - len(s):width] = torch.tensor(s)
            mask[row, width - len(s):] = 1
        batch = RLBatch(input_ids=ids, attention_mask=mask, response_mask=mask[:, width:])
        values = runner.infer(batch, settings, lambda mb, out: {"v": response_values(out, mb)}, ["v"])["v"]
        return values[:, 0].tolist()

    return score


def vllm_scorer(path: Path, max_len: int):
    from vllm import LLM, PoolingParams

    llm = LLM(model=str(path), runner="pooling", dtype="float32", enforce_eager=True, max_model_len=max_len + 8,
              enable_chunked_prefill=False, max_num_batched_tokens=16384, kv_cache_memory_bytes=1 << 30,
              disable_log_stats=True)
    params = PoolingParams(use_activation=False)

    def score(seqs: list[list[int]]) -> list[float]:
        out = llm.classify([{"prompt_token_ids": s} for s in seqs], pooling_params=params, use_tqdm=False)
        return [float(o.outputs.probs[0]) for o in out]

    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=320)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    torch.set_num_threads(1)

    from megarl.devtools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as directory:
        path = make_tiny_model(args.family, args.size, Path(directory) / "rm", seed=0, head="seq_cls")
        seqs = sequences(args.batch, args.max_len, 512)
        tokens = sum(len(s) for s in seqs)
        backends = {"vllm": vllm_scorer(path, args.max_len), "megatron": megatron_scorer(path, args.micro_batch)}
        scores = {name: score(seqs) for name, score in backends.items()}  # warm-up, and the comparison
        diff = max(abs(a - b) for a, b in zip(scores["vllm"], scores["megatron"]))
        ratios = []
        for r in range(args.rounds):
            order = list(backends) if r % 2 == 0 else list(reversed(backends))
            rate = {}
            for name in order:
                start = time.perf_counter()
                backends[name](seqs)
                rate[name] = tokens / (time.perf_counter() - start)
            ratios.append(rate["vllm"] / rate["megatron"])
            print(f"round {r}: vllm {rate['vllm']:,.0f} tok/s, megatron {rate['megatron']:,.0f} tok/s "
                  f"(vllm / megatron {ratios[-1]:.2f})", flush=True)
        print(f"{args.batch} sequences, {tokens} tokens, {args.family}-{args.size}: median vllm / megatron "
              f"tokens/s = {statistics.median(ratios):.2f} over {args.rounds} rounds; max |score difference| = {diff:.2e}")


if __name__ == "__main__":
    main()
