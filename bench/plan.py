"""Benchmark: how long ``megarl plan`` takes for the 70B and 671B configs (target: under 5 s).

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan.py [--runs 3]

For each packaged config (its model's config.json from tests/models/fixtures): the wall time of
the whole command in a fresh process (Python start, imports, composing and checking the config,
the plan, printing it), and, in this process, the time of the plan alone (its first time per
model: the shard layout of every pipeline stage is counted once). The command's time is mostly
imports and config checks (torch, transformers, megatron-core: what ``megarl config show`` pays
too), so the script also prints that baseline.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"grpo_70b": "llama-3.1-70b", "grpo_moe_671b": "deepseek-v3"}


def wall(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megarl.run.cli", *args], cwd=ROOT, capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    from megarl.checks import load_config
    from megarl.plan import gpu, plan_config

    for name, model in CONFIGS.items():
        override = f"actor_rollout_ref.model.path={ROOT / 'tests/models/fixtures' / model}"
        plan_s = statistics.median(wall(["plan", f"configs/{name}.yaml", override]) for _ in range(runs))
        show_s = statistics.median(wall(["config", "show", name, override, "--no-validate"]) for _ in range(runs))
        cfg = load_config(f"configs/{name}.yaml", [override])
        start = time.perf_counter()
        plan_config(cfg, gpu("h100"))
        alone = time.perf_counter() - start
        print(f"{name:14} megarl plan {plan_s:5.2f} s (target < 5 s; median of {runs})  plan alone {alone:5.2f} s  "
              f"megarl config show --no-validate {show_s:5.2f} s")


if __name__ == "__main__":
    main()
