"""Benchmark: the Megatron engine against plain Hugging Face transformers on the same model and batch.

    OMP_NUM_THREADS=1 .venv/bin/python bench/engine.py [--family qwen2] [--size small] [--batch 8] [--seq 256] [--iters 5]

One process, fp32 on CPU: a tiny checkpoint of the ``small`` fixture size (hidden 256, 4 layers)
and one batch of ``--batch`` full-length sequences (half prompt, half response; no padding, so
both sides do the same work). Two ratios from one run, HF / engine (1.0 = as fast as HF;
target >= 1 / 1.3 = 0.77):

1. training: tokens/s of the actor's ``update_policy`` (forward, PPO loss, backward, Adam step
   through megatron's schedule, DDP and distributed optimizer) / tokens/s of a plain HF step
   (forward, the same PPO loss, backward, clip, AdamW);
2. log-probs: time of one HF forward (no grad) + log_softmax / time of ``compute_log_prob``.

Engine and HF iterations alternate, so a load change on the machine hits both; the median of
``--iters`` timed iterations (after one warm-up of each) is reported.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_batch(batch_size: int, seq: int, vocab: int):
    from megarl.engine import RLBatch

    generator = torch.Generator().manual_seed(0)
    prompt, response = seq // 2, seq - seq // 2
    prompts = torch.randint(3, vocab, (batch_size, prompt), generator=generator)
    responses = torch.randint(3, vocab, (batch_size, response), generator=generator)
    ones = torch.ones(batch_size, response, dtype=torch.long)
    return RLBatch.from_parts(prompts, torch.ones_like(prompts), responses, ones, advantages=torch.randn(batch_size, response, generator=generator))


def hf_log_probs(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids).logits[:, batch.prompt_length - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


def hf_step(model, optimizer, batch, loss_fn) -> None:
    optimizer.zero_grad()
    log_probs = hf_log_probs(model, batch)
    loss, _ = loss_fn(old_log_prob=batch.old_log_probs, log_prob=log_probs, advantages=batch.advantages, response_mask=batch.response_mask)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from megarl.algorithms import get_policy_loss
    from megarl.engine import ActorSettings, BatchSettings, MegatronActor, OptimizerSettings
    from megarl.models import ParallelLayout, build_model
    from megarl.platform import init_distributed, initialize_model_parallel
    from megarl.devtools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = make_tiny_model(args.family, args.size, Path(directory) / "model", seed=0)
        init_distributed()
        initialize_model_parallel(seed=0)
        optim = OptimizerSettings(lr=1e-5, weight_decay=0.0)
        settings = ActorSettings(
            train=BatchSettings(micro_batch_size=args.batch), log_prob=BatchSettings(micro_batch_size=args.batch), optim=optim
        )
        actor = MegatronActor(build_model(checkpoint, ParallelLayout(), "actor"), settings)
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="sdpa")
        hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.0)
        loss_fn = get_policy_loss("vanilla")

        batch = make_batch(args.batch, args.seq, hf.config.vocab_size)
        with torch.no_grad():
            batch = batch.with_fields(old_log_probs=hf_log_probs(hf, batch))
        tokens = int(batch.attention_mask.sum())

        def hf_forward():
            with torch.no_grad():
                hf_log_probs(hf.eval(), batch)

        def hf_train():
            hf.train()
            hf_step(hf, hf_optimizer, batch, loss_fn)

        runs = {
            "engine_train": lambda: actor.update_policy(batch),
            "hf_train": hf_train,
            "engine_log_prob": lambda: actor.compute_log_prob(batch),
            "hf_log_prob": hf_forward,
        }
        times = {name: [] for name in runs}
        for iteration in range(args.iters + 1):
            for name, run in runs.items():
                seconds = timed(run)
                if iteration > 0:  # the first round warms up
                    times[name].append(seconds)
        median = {name: statistics.median(values) for name, values in times.items()}

    print(f"model {args.family}/{args.size}, batch {args.batch} x {args.seq} tokens, {torch.get_num_threads()} thread(s), fp32")
    print(f"training step: engine {tokens / median['engine_train']:8.0f} tok/s ({median['engine_train']:.3f} s), "
          f"HF {tokens / median['hf_train']:8.0f} tok/s ({median['hf_train']:.3f} s)")
    print(f"log-probs:     engine {median['engine_log_prob']:.3f} s, HF forward {median['hf_log_prob']:.3f} s")
    print(f"ratio 1 (training tok/s, engine / HF): {median['hf_train'] / median['engine_train']:.2f}  (target >= 0.77, i.e. within 1.3x)")
    print(f"ratio 2 (log-prob time, HF / engine):  {median['hf_log_prob'] / median['engine_log_prob']:.2f}  (target >= 0.77)")


if __name__ == "__main__":
    main()
