"""Send one dict of scalar metrics per step to every configured sink.

Metric names follow verl (``critic/score/mean``, ``actor/pg_loss``, ``timing_s/gen``, ...), so
dashboards built for verl read megarl runs. Sinks are chosen by ``trainer.logger``:

* ``tensorboard``: event files under ``<log_dir>/tensorboard`` (read them with TensorBoard or
  ``EventAccumulator``);
* ``console``: one compact line per step with step, reward, KL and stage times;
* ``jsonl``: ``<log_dir>/metrics.jsonl``, one JSON object per step;
* ``wandb``: only if the ``wandb`` package is installed (it is not a dependency).

``log_generations`` records sample texts (``trainer.log_val_generations``, and
``trainer.log_train_generations`` into ``train_generations.jsonl``): printed with the console
sink, as TensorBoard text, as a wandb table, and always appended to
``<log_dir>/val_generations.jsonl``.

A resumed run calls ``rewind(step)`` with the checkpoint's step: what the interrupted run logged
after it (the steps it trained again) is dropped, so no step appears twice. The JSONL files keep
their records up to ``step``; TensorBoard gets ``purge_step=step + 1`` (its own mechanism: the event
files stay, readers drop the events at and after it); wandb continues its run as before.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TextIO

SINKS = ("console", "tensorboard", "jsonl", "wandb")  # trainer.logger
OPTIONAL_PACKAGES = {"wandb": "wandb"}  # sink -> the package it needs (not a megarl dependency)
GENERATIONS_FILE = "val_generations.jsonl"
TRAIN_GENERATIONS_FILE = "train_generations.jsonl"
METRICS_FILE = "metrics.jsonl"
STEP_FILES = (METRICS_FILE, GENERATIONS_FILE, TRAIN_GENERATIONS_FILE)  # one JSON object per line, with "step"

CONSOLE_KEYS = [("critic/score/mean", "score"), ("critic/rewards/mean", "reward"), ("actor/ppo_kl", "ppo_kl"),
                ("actor/kl_loss", "kl_loss"), ("actor/pg_loss", "pg_loss"), ("critic/vf_loss", "vf_loss"),
                ("response_length/mean", "resp_len"), ("val/score", "val")]


def unavailable_sinks(names: Iterable[str]) -> dict[str, str]:
    """Sinks among ``names`` whose package is not installed -> the package (checked without importing it)."""
    return {name: OPTIONAL_PACKAGES[name] for name in names
            if name in OPTIONAL_PACKAGES and importlib.util.find_spec(OPTIONAL_PACKAGES[name]) is None}


def format_console_line(step: int, metrics: Mapping[str, float]) -> str:
    parts = [f"step {step}"]
    for key, short in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short}={metrics[key]:.4g}")
    timings = [(k.split("/", 1)[1], v) for k, v in metrics.items() if k.startswith("timing_s/")]
    if timings:
        parts.append("time[s] " + " ".join(f"{name}={value:.2f}" for name, value in timings))
    if "perf/throughput" in metrics:
        parts.append(f"tok/s={metrics['perf/throughput']:.0f}")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(self, loggers: Iterable[str], log_dir: str | Path, project: str = "megarl",
                 experiment: str = "default", config: Mapping | None = None, stream: TextIO | None = None,
                 purge_step: int | None = None):
        self.loggers = list(loggers)
        self.log_dir = Path(log_dir)
        self.stream = stream or sys.stdout
        self._tb = self._jsonl = self._wandb = None
        unknown = set(self.loggers) - set(SINKS)
        if unknown:
            raise ValueError(f"unknown loggers {sorted(unknown)}; use {', '.join(SINKS)}")
        self._purge_step = purge_step  # TensorBoard: drop an earlier run's events from this step on
        if "jsonl" in self.loggers:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.log_dir / METRICS_FILE, "a", encoding="utf-8")
        if "wandb" in self.loggers:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError("trainer.logger includes 'wandb' but the wandb package is not installed: "
                                  "pip install wandb, or drop 'wandb' from trainer.logger") from exc
            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}))

    def log(self, metrics: Mapping[str, float], step: int, console: bool = True, progress: str | None = None) -> None:
        """Send the scalars of ``metrics`` to every sink (``console=False``: not the console line, which
        ends with ``progress``, the run's position, rate and ETA, when given)."""
        scalars = {k: float(v) for k, v in metrics.items() if _is_scalar(v)}
        if self._tensorboard() is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if console and "console" in self.loggers:
            line = format_console_line(step, scalars)
            print(f"{line} | {progress}" if progress else line, file=self.stream, flush=True)

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, title: str = "val/generations",
                        file_name: str = GENERATIONS_FILE) -> None:
        """Record sample texts (dicts of prompt, response, ground_truth, score, ...) for ``step``;
        the JSONL file is ``<log_dir>/<file_name>``."""
        if not samples:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / file_name, "a", encoding="utf-8") as out:
            for sample in samples:
                out.write(json.dumps({"step": step, **sample}, default=str) + "\n")
        if "console" in self.loggers:
            print(f"{title} at step {step} ({len(samples)} sample{'s' if len(samples) != 1 else ''}):",
                  file=self.stream)
            for i, sample in enumerate(samples):
                print(f"[{i}] " + " | ".join(f"{k}: {_one_line(v)}" for k, v in sample.items()), file=self.stream)
            self.stream.flush()
        if self._tensorboard() is not None:
            text = "\n\n".join("\n".join(f"**{k}**: `{_one_line(v)}`  " for k, v in s.items()) for s in samples)
            self._tb.add_text(title, text, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            columns = list(samples[0])
            self._wandb.log({title: wandb.Table(columns=columns, data=[[s.get(c) for c in columns] for s in samples])},
                            step=step)

    def _tensorboard(self):
        """The TensorBoard writer, started on the first event (so that a ``rewind`` before it sets its purge step)."""
        if self._tb is None and "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"), purge_step=self._purge_step)
        return self._tb

    def rewind(self, step: int) -> None:
        """Forget what an earlier run logged after ``step`` (a resumed run's checkpoint step)."""
        for name in STEP_FILES:
            _keep_steps_up_to(self.log_dir / name, step)
        if self._jsonl is not None:  # appends continue after the kept records
            self._jsonl.close()
            self._jsonl = open(self.log_dir / METRICS_FILE, "a", encoding="utf-8")
        if "tensorboard" in self.loggers:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            self._purge_step = step + 1

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()


def _keep_steps_up_to(path: Path, step: int) -> None:
    """Rewrite the JSONL file ``path`` with only its records of steps <= ``step`` (atomically)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if _record_step(line) <= step]
    if len(kept) == len(lines):
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(kept), encoding="utf-8")
    os.replace(temporary, path)


def _record_step(line: str) -> float:
    """A JSONL record's step; a line cut short by a crash counts as after every step (it is dropped)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _one_line(value: Any) -> str:
    return str(value).replace("\n", "\\n")


def _is_scalar(value) -> bool:
    """Numbers (NaN and inf included, so a diverging run is visible); not strings or arrays."""
    if isinstance(value, (str, bytes)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
