"""Where the time to the first RL step goes, phase by phase, measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/startup.py [--steps 2] [--compare] [--json FILE] [override ...]

Runs ``megarl.run.train.run`` on the quickstart config (model and data from ``megarl.run.quickstart.prepare``
under ``runs/bench/quickstart``; validation before training off, so the first step starts right
after start-up) and times each start-up phase from outside: the driver's functions are wrapped, and
the Ray timeline gives what ran inside the trainer ranks and the engine replicas. Prints one row per
phase (start and end since the process began, and its own seconds; rows that overlap ran in
parallel), the time to the end of the first step, and the steps after it.

"Ours" is the time to the end of the first step minus what vLLM itself spends starting an engine
(the replica's ``__init__``: importing vLLM in the replica, its engine-core and worker processes,
loading the model) and minus one steady step: Ray, the driver, the trainer ranks where they are on
the critical path, the connects, and the first step's extra cost.

``--compare`` runs it twice, each in a fresh process: ``before`` with megarl's two start-up cuts
undone (the trainer ranks start before the fleet, one after the other; CPU engines in eager mode
compile vLLM's sampler helpers on the first request) and ``after`` as shipped, then prints both
and the ratio of "ours".
"""
from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

RUN_DIR = Path("runs/bench/quickstart")


class Timeline:
    """Named intervals (seconds since the process started) of wrapped calls."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float]] = []

    def wrap(self, owner, attribute: str, name: str, first_only: bool = False) -> None:
        original = getattr(owner, attribute)
        rows = self.rows

        def timed(*args, **kwargs):
            if first_only and any(row[0] == name for row in rows):
                return original(*args, **kwargs)
            start = time.perf_counter() - PROCESS_START
            try:
                return original(*args, **kwargs)
            finally:
                rows.append((name, start, time.perf_counter() - PROCESS_START))

        setattr(owner, attribute, timed)

    def mark(self, name: str, start: float) -> None:
        self.rows.append((name, start, time.perf_counter() - PROCESS_START))


def ray_phases(timeline_file: Path, offset: float) -> list[tuple[str, float, float]]:
    """Per actor class and method: the span from the first start to the last end (Ray's timeline,
    microseconds since the epoch), shifted onto this process's clock by ``offset``."""
    spans: dict[str, list[float]] = {}
    for event in json.loads(timeline_file.read_text()):
        name = str(event.get("cat", ""))
        if event.get("ph") != "X" or not name.startswith("task::") or name.endswith(".generate_tokens"):
            continue
        name = name.removeprefix("task::")
        start, end = event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6
        span = spans.setdefault(name, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    return [(f"  in Ray: {name}", s - offset, e - offset) for name, (s, e) in spans.items()]


def undo_startup_cuts() -> None:
    """The ``before`` variant: ranks then fleet, one after the other; the engines' compiled helpers on."""
    from megarl.rollout.vllm import engine_config
    from megarl.cluster import startup

    def one_after_another(timings=None, **starters):
        results = {}
        for name, starter in starters.items():
            began = time.perf_counter()
            results[name] = starter()
            if timings is not None:
                timings[name] = time.perf_counter() - began
        return results

    startup.start_together = one_after_another
    env_of = engine_config.replica_env
    engine_config.replica_env = lambda spec, on_gpu: {k: v for k, v in env_of(spec, on_gpu).items() if k != "TORCHDYNAMO_DISABLE"}
    import megarl.rollout.fleet as fleet_module

    fleet_module.replica_env = engine_config.replica_env


def summary(record: dict) -> dict[str, float]:
    """Time to the end of the first step, vLLM's own engine start, one steady step, and ours."""
    steps = record["steps"]
    engine = max((end - begin for name, begin, end in record["phases"] if name.endswith("EngineReplica.__init__")),
                 default=0.0)
    first_end = record["first_step"] + steps[0]
    steady = steps[-1] if len(steps) > 1 else 0.0
    return {"to_first_step_end": first_end, "vllm_engine_start": engine, "steady_step": steady,
            "ours": first_end - engine - steady}


def compare(args) -> None:
    import subprocess

    records = {}
    for variant in ("before", "after"):
        out = Path(tempfile.mkdtemp(prefix="megarl_startup_")) / f"{variant}.jsonl"
        command = [sys.executable, __file__, "--variant", variant, "--steps", str(args.steps), "--json", str(out),
                   *args.overrides]
        subprocess.run(command, check=True)
        records[variant] = json.loads(out.read_text().splitlines()[-1])
        if args.json:
            with args.json.open("a") as sink:
                sink.write(json.dumps(records[variant]) + "\n")
    print("\nstart-up, before and after megarl's cuts (one invocation, two fresh processes)")
    print(f"{'':<26} {'before':>8} {'after':>8} {'after/before':>13}")
    rows = {variant: summary(record) for variant, record in records.items()}
    for key in ("to_first_step_end", "vllm_engine_start", "steady_step", "ours"):
        before, after = rows["before"][key], rows["after"][key]
        print(f"{key:<26} {before:8.1f} {after:8.1f} {after / before if before else float('nan'):13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="RL steps to run (the first one ends start-up)")
    parser.add_argument("--json", type=Path, help="append the phases as one JSON line to this file")
    parser.add_argument("--compare", action="store_true", help="before and after megarl's start-up cuts, in one run")
    parser.add_argument("--variant", choices=["before", "after"], default="after", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides, verl's form")
    args = parser.parse_args()
    if args.compare:
        return compare(args)
    if args.variant == "before":
        undo_startup_cuts()

    import logging

    logging.basicConfig(level=logging.WARNING)
    imports_start = time.perf_counter() - PROCESS_START
    import megarl.run.train as train
    from megarl.checks import load_config
    from megarl.run.quickstart import prepare

    line = Timeline()
    line.mark("import megarl.run.train", imports_start)
    inputs = prepare(RUN_DIR)
    timeline_file = Path(tempfile.mkdtemp(prefix="megarl_startup_")) / "ray_timeline.json"
    overrides = [f"data.train_files={inputs['data'] / 'train.parquet'}", f"data.val_files={inputs['data'] / 'test.parquet'}",
                 f"actor_rollout_ref.model.path={inputs['model']}", f"trainer.default_local_dir={RUN_DIR / 'run'}",
                 "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 "trainer.resume_mode=disable", f"trainer.total_training_steps={args.steps}", "trainer.logger=[console]",
                 f"ray_kwargs.timeline_json_file={timeline_file}", *args.overrides]
    start = time.perf_counter() - PROCESS_START
    cfg = load_config("quickstart", overrides, preflight=True)
    line.mark("config (load, validate, preflight)", start)

    from megarl.rollout import fleet as fleet_module
    from megarl.cluster import placement, ray_cluster, worker_group
    from megarl.run import loop
    from megarl.trainer import controller
    from megarl.weight_sync import session

    line.wrap(ray_cluster, "init_ray", "Ray: init (local cluster)")
    line.wrap(placement, "ClusterPlacement", "placement group")
    line.wrap(worker_group.WorkerGroup, "__init__", "trainer ranks (WorkerGroup)")
    line.wrap(fleet_module.RolloutFleet, "__init__", "rollout fleet (RolloutFleet)")
    line.wrap(session.WeightSyncSession, "__init__", "weight-sync connect")
    line.wrap(loop.TrainingLoop, "resume", "resume / first sync")
    steps: list[tuple[float, float]] = []
    original_step = controller.RLTrainer.train_step

    def timed_step(self, step):
        begin = time.perf_counter() - PROCESS_START
        try:
            return original_step(self, step)
        finally:
            steps.append((begin, time.perf_counter() - PROCESS_START))

    controller.RLTrainer.train_step = timed_step
    run_start = time.perf_counter() - PROCESS_START
    # Ray's timeline clock is the wall clock: map it onto ours
    wall_offset = time.time() - (time.perf_counter() - PROCESS_START)
    train.run(cfg)
    line.mark("train.run (whole)", run_start)
    rows = sorted(line.rows + (ray_phases(timeline_file, wall_offset) if timeline_file.is_file() else []),
                  key=lambda row: row[1])
    first_step = steps[0][0] if steps else float("nan")
    print(f"\nstart-up of the quickstart config (processes started from nothing; {len(steps)} steps)")
    print(f"{'phase':<52} {'start':>7} {'end':>7} {'seconds':>8}")
    for name, begin, end in rows:
        print(f"{name:<52} {begin:7.1f} {end:7.1f} {end - begin:8.1f}")
    print(f"time to the first step: {first_step:.1f} s since the process started "
          f"({first_step - run_start:.1f} s inside train.run)")
    for i, (begin, end) in enumerate(steps, 1):
        print(f"step {i}: {end - begin:.2f} s")
    record = {"variant": args.variant, "phases": rows, "first_step": first_step, "run_start": run_start,
              "steps": [end - begin for begin, end in steps], "argv": sys.argv[1:]}
    print("  ".join(f"{key} {value:.1f} s" for key, value in summary(record).items()))
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
