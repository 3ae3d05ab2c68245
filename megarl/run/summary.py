"""The end-of-run summary: where the time went, how fast, how good, and where everything is.

``RunSummary`` is fed by the training loop (each step's metrics, the time of start-up,
validation and checkpoints) and prints a few lines when the run ends:

    done: steps 1-120 of 120 in 5m02s: start-up 28 s (9%), training 4m10s (83%), validation 12 s (4%), ...
      step time by phase: gen 1m05s (26%) | old_log_prob 22 s (9%) | update 1m52s (45%) | sync 8 s (3%) | other ...
      throughput: 41,230 tokens/s (prompt + response, all devices); 9,870 response tokens/s while generating
      validation score: best 1.000 at step 100, final 1.000 at step 120 (0.080 at step 0)
      optimizer steps skipped (non-finite gradients): actor 2 of 120        (only when some were)
      TensorBoard: ...; checkpoints: ...; samples: ...; reward curve: ...; logs: ...

The step phases are the controller's ``timing_s/*`` (verl's names): ``gen`` (rollout, with the
greedy baselines of ReMax), ``reward``, ``old_log_prob``, ``ref``, ``values``, ``update`` (actor
and critic), ``sync`` (weight sync and the engines' wake-up) and ``other`` (advantages and the
controller's own work: the step's time minus the phases).
"""
from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from megarl.logging.progress import duration

# summary phase -> the timing_s/* keys it adds up (in display order)
STEP_PHASES = {"gen": ("gen",), "reward": ("reward",), "old_log_prob": ("old_log_prob",), "ref": ("ref",),
               "values": ("values",), "update": ("update_actor", "update_critic"), "sync": ("sync", "wake")}
ALWAYS_SHOWN = ("gen", "old_log_prob", "update", "sync")


class RunSummary:
    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.started = time.perf_counter()
        self.seconds: Counter[str] = Counter()  # start-up, training, validation, checkpoints
        self.phases: Counter[str] = Counter()  # step time by STEP_PHASES name, plus "other"
        self.steps: list[int] = []
        self.tokens = 0.0
        self.response_tokens = 0.0
        self.validations: list[tuple[int, float]] = []
        self.skipped_steps = ""  # optimizer steps skipped for non-finite gradients ("actor 2 of 120"), if any

    @contextmanager
    def timed(self, part: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start

    def record_step(self, step: int, metrics: dict) -> None:
        self.steps.append(step)
        step_s = float(metrics.get("timing_s/step", 0.0))
        self.seconds["training"] += step_s
        named = 0.0
        for phase, keys in STEP_PHASES.items():
            seconds = sum(float(metrics.get(f"timing_s/{key}", 0.0)) for key in keys)
            self.phases[phase] += seconds
            named += seconds
        self.phases["other"] += max(0.0, step_s - named)
        self.tokens += float(metrics.get("perf/total_num_tokens", 0.0))
        per_token_ms = float(metrics.get("timing_per_token_ms/gen", 0.0))
        if per_token_ms > 0:  # the step's response tokens: gen seconds / seconds per response token
            self.response_tokens += 1000.0 * float(metrics.get("timing_s/gen", 0.0)) / per_token_ms
        if "val/score" in metrics:
            self.record_validation(step, float(metrics["val/score"]))

    def record_validation(self, step: int, score: float) -> None:
        self.validations = [(s, v) for s, v in self.validations if s != step] + [(step, score)]

    def add_history(self, history: list[dict]) -> None:
        """Validation scores of the steps a resumed run did before (the checkpoint's history)."""
        for entry in history:
            if "val/score" in entry:
                self.record_validation(int(entry["step"]), float(entry["val/score"]))

    def lines(self, places: dict[str, str]) -> list[str]:
        wall = time.perf_counter() - self.started
        out = [self._headline(wall)]
        step_total = sum(self.phases.values())
        if step_total > 0:
            shown = [p for p in (*STEP_PHASES, "other")
                     if p in ALWAYS_SHOWN or p == "other" or self.phases[p] >= 0.01 * step_total]
            folded = sum(self.phases[p] for p in STEP_PHASES if p not in shown)
            parts = [f"{p} {duration(self.phases[p] + (folded if p == 'other' else 0))} "
                     f"({100 * (self.phases[p] + (folded if p == 'other' else 0)) / step_total:.0f}%)" for p in shown]
            out.append("  step time by phase: " + " | ".join(parts))
        if self.seconds["training"] > 0 and self.tokens:
            text = (f"  throughput: {self.tokens / self.seconds['training']:,.0f} tokens/s (prompt + response "
                    "tokens over the steps' time, all devices)")
            if self.response_tokens and self.phases["gen"] > 0:
                text += f"; {self.response_tokens / self.phases['gen']:,.0f} response tokens/s while generating"
            out.append(text)
        if self.validations:
            best = max(self.validations, key=lambda sv: (sv[1], -sv[0]))
            final = max(self.validations)
            first = min(self.validations)
            text = f"  validation score: best {best[1]:.3f} at step {best[0]}, final {final[1]:.3f} at step {final[0]}"
            if first[0] not in (final[0], best[0]):
                text += f" ({first[1]:.3f} at step {first[0]})"
            out.append(text)
        if self.skipped_steps:
            out.append(f"  optimizer steps skipped (non-finite gradients): {self.skipped_steps}")
        for name, where in places.items():
            if where:
                out.append(f"  {name}: {where}")
        return out

    def _headline(self, wall: float) -> str:
        if self.steps:
            span = f"steps {self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1 else f"step {self.steps[0]}"
            what = f"{span} of {self.total_steps}"
        else:
            what = "no training steps"
        parts = []
        accounted = 0.0
        for part in ("start-up", "training", "validation", "checkpoints"):
            if self.seconds[part] > 0:
                parts.append(f"{part} {duration(self.seconds[part])} ({100 * self.seconds[part] / wall:.0f}%)")
                accounted += self.seconds[part]
        if wall - accounted > 0.5:
            parts.append(f"other {duration(wall - accounted)} ({100 * (wall - accounted) / wall:.0f}%)")
        return f"done: {what} in {duration(wall)}: " + ", ".join(parts)


def places(run_dir: str | Path, loggers, checkpoint: Path | None, sample_files: list[Path], reward_curve: Path | None,
           log_dir: Path | None) -> dict[str, str]:
    """Where a run's outputs are, for the summary's last lines (only what exists)."""
    run_dir = Path(run_dir)
    out: dict[str, str] = {}
    if "tensorboard" in loggers:
        out["TensorBoard"] = f"{run_dir / 'tensorboard'} (tensorboard --logdir {run_dir} --host 127.0.0.1)"
    if "jsonl" in loggers:
        out["metrics"] = str(run_dir / "metrics.jsonl")
    out["checkpoint"] = f"{checkpoint} (the latest)" if checkpoint else ""
    out["samples"] = ", ".join(str(p) for p in sample_files if Path(p).exists())
    out["reward curve"] = str(reward_curve) if reward_curve else ""
    out["logs"] = f"{log_dir}/ (driver.log and one file per worker)" if log_dir else ""
    return out
