"""``trainer.max_restarts``: a run that lost a worker process starts again from its last complete checkpoint.

A lost trainer rank cannot be recovered inside a step (its shard of the weights and optimizer state is
gone, and torch.distributed's world with it), so the run stops: ``ProcessWatch`` names the rank within
seconds (``WorkerDied``) and the entry point prints that message with the last lines of the rank's log.
With ``trainer.max_restarts=N`` the driver instead starts the whole run again, at most N times, one
console line per restart; every step logs ``run/restarts`` (TensorBoard, metrics.jsonl).

The restart happens in the same driver process, not by re-exec: every attempt of the run
(``megarl.run.train._run``) already tears down everything it started on every exit path (the trainer,
the rollout engines, the placement groups, the local Ray cluster and its temp dir, or its connection to
an external one), which the interrupt and fault tests check, and the next attempt builds everything
again from the config exactly as a second launch of the same command would, resuming from the newest
whole checkpoint (``trainer.resume_mode=auto``). Staying in the process keeps the console, the driver
log, the interrupt guard and a Slurm job's process tree as they are; a re-exec would gain nothing but
a fresh interpreter. Only ``WorkerDied`` restarts: an interrupt, a config or data error, a diverged
run or a bug in the code would fail the same way again.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, TypeVar

from megarl.cluster.process_watch import WorkerDied

logger = logging.getLogger(__name__)
T = TypeVar("T")
LOG_TAIL_LINES = 10


def run_with_restarts(attempt: Callable[[int], T], max_restarts: int,
                      before_restart: Callable[[int, WorkerDied], None],
                      stop_requested: Callable[[], bool] = lambda: False) -> T:
    """``attempt(restarts)`` until it returns; a ``WorkerDied`` calls ``before_restart(restarts, exc)`` and
    tries again, at most ``max_restarts`` times, then propagates. Never after ``stop_requested()``: a
    worker that died after a SIGTERM (Slurm's, which reaches every process of a job) ends the run."""
    restarts = 0
    while True:
        try:
            return attempt(restarts)
        except WorkerDied as exc:
            if restarts >= max_restarts or stop_requested():
                raise
            restarts += 1
            before_restart(restarts, exc)


def prepare_restart(trainer_cfg, root: str | Path, started: float) -> tuple[int, Path] | None:
    """Before a restart: the checkpoint it resumes from, (step, path), or None (it starts over). A run
    that saved since it ``started`` (``time.time()``) resumes from that save even when its
    ``trainer.resume_mode`` (disable, resume_path) chose another start the first time."""
    from megarl.trainer.checkpointing import latest_checkpoint_step

    last = latest_checkpoint_step(root)
    ours = last is not None and Path(last[1]).stat().st_mtime >= started
    if ours and trainer_cfg.resume_mode != "auto":
        logger.info("restart: trainer.resume_mode=%s -> auto, to resume from %s", trainer_cfg.resume_mode, last[1])
        trainer_cfg.resume_mode = "auto"
    if trainer_cfg.resume_mode == "auto" or ours:
        return last
    return None  # disable: starts over; resume_path: from trainer.resume_from_path again


def restart_line(restarts: int, max_restarts: int, exc: WorkerDied, resumes: tuple[int, Path] | None) -> str:
    """The console's line for one restart."""
    cause = str(exc).split("; its output is in")[0]
    where = f"from the checkpoint of step {resumes[0]}" if resumes is not None else "from the start (no checkpoint yet)"
    return f"restart {restarts} of {max_restarts} (trainer.max_restarts): {cause}; starting the run again {where}"


def log_tail(exc: WorkerDied, log_dir: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of each dead rank's log, indented, for the error message ('' if none)."""
    parts = []
    for name in exc.logs:
        path = Path(log_dir) / name
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        if tail:
            parts.append(f"last lines of {path}:\n" + "\n".join(f"  {line}" for line in tail))
    return "\n".join(parts)
