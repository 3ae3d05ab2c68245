"""The rollout fleet's generation tokens/s against bare ``vllm.LLM.generate``, measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout.py [--model tiny|smollm2] [--prompts 32] [--n 4]
                                                       [--short 8] [--long 128] [--replicas 1 2] [--rounds 3]

Same model, prompts, sampling (temperature 1, per-prompt seeds as the fleet derives them, ``ignore_eos``
so every sample has exactly the asked number of tokens, sampled-token log-probs on both sides) and
engine arguments (``engine_config.llm_kwargs``) everywhere. For each response length (short, long) and
replica count (1, 2) it times, round after round in alternating order so drift in the machine's load
cancels out:

* ``fleet``: ``RolloutFleet.generate``, the batch call (one Ray call per replica);
* ``seam``: ``AgentRollout.generate`` with the single-turn loop, the trainer's path (one Ray call per sample);
* ``bare``: ``vllm.LLM.generate`` in one plain process per replica (vLLM's default engine-core process);
* ``bare-inproc``: the same with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core inside the process, vLLM's
  synchronous engine), for reference. The fleet's replicas run theirs that way too on CPU at TP=1
  (``megarl/rollout/vllm/inproc_core.py``); export ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` to time vLLM's
  engine-core process instead.

Each engine gets ``--cpus`` OpenMP threads (default 1, so two replicas fit 2 cores). Prints tokens/s
(median over rounds), the ratios fleet/bare and seam/bare (target >= 0.9) and whether the fleet's
tokens equal bare vLLM's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE_WORKER = "--bare-worker"


def bare_worker(config_json: str) -> None:
    """One plain vLLM engine: JSON jobs on stdin, JSON results on stdout (one line each)."""
    config = json.loads(config_json)
    os.environ.update(config["env"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**config["engine"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        params = [SamplingParams(**job["sampling"], seed=seed) for seed in job["seeds"]]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        ids = [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]
        print(json.dumps({"seconds": seconds, "ids": ids}), flush=True)


class BareEngines:
    """One ``bare_worker`` process per replica, each serving its contiguous share of the prompts."""

    def __init__(self, engine_kwargs: dict, env: dict, replicas: int, inproc: bool):
        config = {"engine": engine_kwargs, "env": {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if inproc else "1"}}
        self.procs = [subprocess.Popen([sys.executable, __file__, BARE_WORKER, json.dumps(config)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for _ in range(replicas)]
        for proc in self.procs:
            self._read(proc)

    @staticmethod
    def _read(proc) -> dict:
        for line in proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"bare vLLM worker {proc.pid} exited with {proc.wait()}")

    def generate(self, prompts, seeds, sampling) -> tuple[float, list]:
        from megarl.rollout.fleet import split_evenly

        start = time.perf_counter()
        chunks = split_evenly(len(prompts), len(self.procs))
        for proc, chunk in zip(self.procs, chunks):
            proc.stdin.write(json.dumps({"prompts": [prompts[i] for i in chunk], "seeds": [seeds[i] for i in chunk],
                                         "sampling": sampling}) + "\n")
            proc.stdin.flush()
        ids = [sample for proc in self.procs for prompt in self._read(proc)["ids"] for sample in prompt]
        return time.perf_counter() - start, ids

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
            proc.wait(timeout=120)


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i % 9} + {i % 7}? Show your working."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(count)]


def model_path(name: str) -> Path:
    if name == "smollm2":
        from megarl.devtools.pretrained import pretrained_model

        return Path(pretrained_model("smollm2"))
    from megarl.run.quickstart import RUN_DIR, prepare

    return prepare(Path("runs/bench") / RUN_DIR.name)["model"]


def measure(args, model: Path, tokenizer, replicas: int, tokens: int) -> dict:
    from megarl.agent import AgentContext, AgentRollout, MultiTurnSettings
    from megarl.config.schema import RolloutConfig
    from megarl.rollout import RolloutFleet
    from megarl.rollout.vllm.engine_config import llm_kwargs, replica_env
    from megarl.rollout.sampling import request_seed, resolve_sampling

    prompts = make_prompts(tokenizer, args.prompts)
    config = RolloutConfig(prompt_length=max(map(len, prompts)), response_length=tokens, tensor_model_parallel_size=1,
                           n=args.n, temperature=1.0, max_num_seqs=256, max_num_batched_tokens=8192, seed=0)
    sampling = {"ignore_eos": True}
    fleet = RolloutFleet(config, str(model), num_replicas=replicas, cpus_per_replica=args.cpus)
    spec = fleet.spec
    engine = {k: v for k, v in llm_kwargs(spec, on_gpu=False).items() if k != "worker_extension_cls"}
    env = replica_env(spec, on_gpu=False)
    bare = {"bare": BareEngines(engine, env, replicas, inproc=False),
            "bare-inproc": BareEngines(engine, env, replicas, inproc=True)}
    seam = AgentRollout(AgentContext(tokenizer=tokenizer, response_length=tokens, multi_turn=MultiTurnSettings()),
                        fleet, config)
    columns = {"prompt_ids": prompts, "raw_prompt": [[{"role": "user", "content": "q"}]] * len(prompts),
               "extra_info": [{}] * len(prompts)}
    vllm_sampling = resolve_sampling(config, sampling).engine_kwargs()
    vllm_sampling["logprobs"] = 0  # the fleet always asks for the sampled tokens' log-probs

    def run_fleet(step):
        start = time.perf_counter()
        samples = fleet.generate(prompts, sampling, step=step)
        return time.perf_counter() - start, [s.response_ids for s in samples]

    def run_seam(step):
        start = time.perf_counter()
        trajectories = seam.generate(columns, step=step, sampling=sampling)
        return time.perf_counter() - start, [t.response_ids for t in trajectories]

    def run_bare(name):
        return lambda step: bare[name].generate(prompts, [request_seed(spec.seed, step, i) for i in range(len(prompts))],
                                                vllm_sampling)

    paths = {"fleet": run_fleet, "seam": run_seam, "bare": run_bare("bare"), "bare-inproc": run_bare("bare-inproc")}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    same = True
    try:
        for step in range(args.rounds + 1):  # step 0 warms every path up
            order = list(paths) if step % 2 == 0 else list(reversed(paths))
            outputs = {}
            for name in order:
                seconds, ids = paths[name](step)
                outputs[name] = ids
                if step:
                    rates[name].append(sum(map(len, ids)) / seconds)
            same = same and outputs["fleet"] == outputs["bare"] == outputs["seam"]
    finally:
        for engines in bare.values():
            engines.close()
        fleet.shutdown()
    result = {name: statistics.median(values) for name, values in rates.items()}
    result["same_tokens"] = same
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == BARE_WORKER:
        return bare_worker(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--short", type=int, default=8, help="tokens per sample, short responses")
    parser.add_argument("--long", type=int, default=128, help="tokens per sample, long responses")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=1, help="OpenMP threads per engine")
    parser.add_argument("--json", type=Path, help="append the results as one JSON line to this file")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    model = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    init_ray(num_cpus=max(2, max(args.replicas) * args.cpus), temp_dir=tempfile.mkdtemp(prefix="ray_", dir="/tmp"))
    results = []
    try:
        for tokens in (args.short, args.long):
            for replicas in args.replicas:
                got = measure(args, model, tokenizer, replicas, tokens)
                results.append({"tokens": tokens, "replicas": replicas, **got})
                print(f"[{args.model}] {tokens} tokens x {replicas} replica(s): " +
                      ", ".join(f"{k} {v:.0f} tok/s" for k, v in got.items() if k != "same_tokens") +
                      f"; fleet/bare {got['fleet'] / got['bare']:.2f}, seam/bare {got['seam'] / got['bare']:.2f}, "
                      f"same tokens: {got['same_tokens']}", flush=True)
    finally:
        shutdown_ray()
    print(f"\n{args.model}: {args.prompts} prompts x n={args.n}, temperature 1, {args.cpus} thread(s) per engine, "
          f"median of {args.rounds} rounds")
    print(f"{'tokens':>6} {'replicas':>8} {'fleet':>8} {'seam':>8} {'bare':>8} {'inproc':>8} {'fleet/bare':>10} "
          f"{'seam/bare':>9} {'same':>5}")
    for r in results:
        print(f"{r['tokens']:6d} {r['replicas']:8d} {r['fleet']:8.0f} {r['seam']:8.0f} {r['bare']:8.0f} "
              f"{r['bare-inproc']:8.0f} {r['fleet'] / r['bare']:10.2f} {r['seam'] / r['bare']:9.2f} {str(r['same_tokens']):>5}")
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps({"model": args.model, "args": vars(args) | {"json": str(args.json)}, "results": results}) + "\n")


if __name__ == "__main__":
    main()
