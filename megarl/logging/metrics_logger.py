"""Send one dict of scalar metrics per step to every configured sink.

Metric names follow verl (``critic/score/mean``, ``actor/pg_loss``, ``timing_s/gen``, ...), so
dashboards built for verl read megarl runs. Sinks are chosen by ``trainer.logger``:

* ``tensorboard``: event files under ``<log_dir>/tensorboard`` (read them with TensorBoard or
  ``EventAccumulator``);
* ``console``: one compact line per step with step, reward, KL and stage times;
* ``jsonl``: ``<log_dir>/metrics.jsonl``, one JSON object per step;
* ``wandb``: only if the ``wandb`` package is installed (it is not a dependency).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable, Mapping, TextIO

CONSOLE_KEYS = [("critic/score/mean", "score"), ("critic/rewards/mean", "reward"), ("actor/ppo_kl", "ppo_kl"),
                ("actor/kl_loss", "kl_loss"), ("actor/pg_loss", "pg_loss"), ("critic/vf_loss", "vf_loss"),
                ("response_length/mean", "resp_len"), ("val/score", "val")]


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
        unknown = set(self.loggers) - {"console", "tensorboard", "jsonl", "wandb"}
        if unknown:
            raise ValueError(f"unknown loggers {sorted(unknown)}; use console, tensorboard, jsonl or wandb")
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events at or after it, so a resumed run does not leave duplicates
            self._tb = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"), purge_step=purge_step)
        if "jsonl" in self.loggers:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a", encoding="utf-8")
        if "wandb" in self.loggers:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError("trainer.logger includes 'wandb' but the wandb package is not installed: "
                                  "pip install wandb, or drop 'wandb' from trainer.logger") from exc
            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if _is_scalar(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if "console" in self.loggers:
            print(format_console_line(step, scalars), file=self.stream, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()


def _is_scalar(value) -> bool:
    """Numbers (NaN and inf included, so a diverging run is visible); not strings or arrays."""
    if isinstance(value, (str, bytes)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
