"""Where the time to the first RL step goes, phase by phase, measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/startup.py [--steps 2] [--json FILE] [override ...]

Runs ``megarl.train.run`` on the quickstart config (model and data from ``megarl.quickstart.prepare``
under ``runs/bench/quickstart``; validation before training off, so the first step starts right
after start-up) and times each start-up phase from outside: the driver's functions are wrapped, and
the Ray timeline gives what ran inside the trainer ranks and the engine replicas. Prints one row per
phase (start and end since the process began, and its own seconds; rows that overlap ran in
parallel), the time to the first step, and the steps after it.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="RL steps to run (the first one ends start-up)")
    parser.add_argument("--json", type=Path, help="append the phases as one JSON line to this file")
    parser.add_argument("overrides", nargs="*", help="config overrides, verl's form")
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    imports_start = time.perf_counter() - PROCESS_START
    import megarl.train as train
    from megarl.config import load_config
    from megarl.quickstart import prepare

    line = Timeline()
    line.mark("import megarl.train", imports_start)
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
    from megarl.trainer import controller, placement, ray_cluster, worker_group
    from megarl.weight_sync import session

    line.wrap(ray_cluster, "init_ray", "Ray: init (local cluster)")
    line.wrap(placement, "ClusterPlacement", "placement group")
    line.wrap(worker_group.WorkerGroup, "__init__", "trainer ranks (WorkerGroup)")
    line.wrap(fleet_module.RolloutFleet, "__init__", "rollout fleet (RolloutFleet)")
    line.wrap(session.WeightSyncSession, "__init__", "weight-sync connect")
    line.wrap(controller.TrainingLoop, "resume", "resume / first sync")
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
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps({"phases": rows, "first_step": first_step, "run_start": run_start,
                                  "steps": [end - begin for begin, end in steps], "argv": sys.argv[1:]}) + "\n")


if __name__ == "__main__":
    main()
