"""Worker output in files under the run directory, named by worker; warnings and errors on the console.

Worker side: every Ray actor of a run (``DistributedWorker`` ranks, rollout replicas, agent-loop
workers) calls ``capture_worker_output(name)`` first in its ``__init__``. When the run set
``MEGARL_WORKER_LOG_DIR`` (``worker_log_env``; ``init_ray`` passes it to every worker) the
process's file descriptors 1 and 2 are pointed at ``<dir>/<name>.log`` (appended), so everything
lands there: Python logging (one line per record, levels named), Python warnings, C-level
output (gloo, oneDNN), and every child process, which inherits them (vLLM's engine core and TP
workers, megatron's checkpoint helpers). Without the variable (tests, a standalone fleet)
nothing changes.

Driver side: ``WorkerLogFollower`` reads the files as they grow (every half second), groups each
line with its continuation lines (a warning's source line, a traceback) and logs warnings and
errors through ``megarl.workers.<name>``, so the console rules apply to them
(``megarl.logging.console``: known dependency warnings counted, repeats across ranks shown
once). With ``DEBUG`` every line is passed on. Reading files instead of a pipe means a worker
never blocks or dies on its output, whatever happens to the driver; on several nodes it needs
the run directory on a shared filesystem, which checkpoints need anyway (without one, errors
still reach the driver as exceptions).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.logging.console import WORKER_LOGGER, console_state

LOG_DIR_ENV = "MEGARL_WORKER_LOG_DIR"
DRIVER_LOG = "driver.log"
WORKER_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the follower reads the level from it

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "WARN": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL, "FATAL": logging.CRITICAL}
# "2026-12-01 11:20:38,416 WARNING name: ..." (ours), "(Worker pid=8) WARNING 12-01 11:21:07 [f.py:266] ..." (vLLM),
# "WARNING:root:..." (logging's last resort)
_LEVELLED = re.compile(r"^(?:\(\S+ pid=\d+\)\s+)?(?:[\d][\d\-: ,.]*\s+)?(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
_TORCH_C10 = re.compile(r"^\[([WE])\d{4} ")  # "[W1201 11:20:57.35 utils.cpp:68] Warning: ..."
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")  # warnings.showwarning's format, in processes we do not configure
_MEGARL_RECORD = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) megarl[\w.]*: ")


def worker_log_env(log_dir: str | Path) -> dict[str, str]:
    """Environment that makes a run's workers write their output under ``log_dir``."""
    return {LOG_DIR_ENV: str(Path(log_dir).resolve())}


def capture_worker_output(name: str) -> Path | None:
    """Send this process's output (and its children's) to ``$MEGARL_WORKER_LOG_DIR/<name>.log``.

    Returns the file, or None when the variable is unset (then output is left where it is and
    INFO records are printed, as before). A captured worker also blocks SIGINT, for itself and
    the processes it starts: Ctrl-C in a terminal reaches the whole process group, and the driver
    is the one that stops the run, engines and workers in order (``megarl.run.interrupts``).
    Ray starts its workers with SIGINT unblocked, and vLLM's engine processes would shut
    themselves down on it mid-teardown.
    """
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        logging.basicConfig(level=logging.INFO, format=WORKER_FORMAT)
        return None
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # inherited by every child process
    path = Path(log_dir) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):  # not a TextIOWrapper
            pass
    print(f"==== {name} (pid {os.getpid()}) started {time.strftime('%Y-%m-%d %H:%M:%S')} ====", flush=True)
    logging.basicConfig(level=logging.INFO, format=WORKER_FORMAT, stream=sys.stderr, force=True)
    logging.captureWarnings(True)
    return path


@dataclass
class _Record:
    level: int
    lines: list[str]
    in_traceback: bool = False


@dataclass
class _File:
    path: Path
    offset: int
    partial: str = ""
    pending: _Record | None = None
    idle_polls: int = 0


def line_level(line: str) -> int | None:
    """The level a worker's log line states, or None for plain output."""
    match = _LEVELLED.match(line)
    if match:
        return _LEVELS[match.group(1)]
    match = _TORCH_C10.match(line)
    if match:
        return logging.WARNING if match.group(1) == "W" else logging.ERROR
    if _PY_WARNING.match(line):
        return logging.WARNING
    return None


class WorkerLogFollower:
    """Follows ``<log_dir>/*.log`` (not the driver's own) and logs what the console should see.

    Files that exist when it starts are followed from their end (a resumed run does not replay
    the last run's output). ``poll()`` reads what is new; ``start()`` polls in a thread until
    ``stop()``, which polls a last time.
    """

    def __init__(self, log_dir: str | Path, interval_s: float = 0.5):
        self.log_dir = Path(log_dir)
        self.interval_s = interval_s
        self._files: dict[Path, _File] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for path in self._log_files():
            self._files[path] = _File(path, path.stat().st_size)

    def _log_files(self) -> list[Path]:
        if not self.log_dir.is_dir():
            return []
        return sorted(p for p in self.log_dir.glob("*.log") if p.name != DRIVER_LOG)

    def start(self) -> "WorkerLogFollower":
        self._thread = threading.Thread(target=self._run, name="megarl-worker-logs", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll(flush=True)

    def poll(self, flush: bool = False) -> None:
        """Read every file's new lines; log the finished records (all pending ones with ``flush``)."""
        with self._lock:
            for path in self._log_files():
                state = self._files.setdefault(path, _File(path, 0))
                self._read(state)
                if state.pending is not None and (flush or state.idle_polls > 0):
                    self._finish(state)

    def _read(self, state: _File) -> None:
        try:
            with open(state.path, "rb") as f:
                f.seek(state.offset)
                data = f.read()
        except OSError:
            return
        if not data:
            state.idle_polls += 1
            return
        state.idle_polls = 0
        state.offset += len(data)
        text = state.partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        state.partial = lines.pop()  # an unfinished last line waits for the rest
        for line in lines:
            self._line(state, line.rstrip("\r"))

    def _line(self, state: _File, line: str) -> None:
        record = state.pending
        if record is not None and self._continues(record, line):
            record.lines.append(line)
            return
        if record is not None:
            self._finish(state)
        level = line_level(line)
        state.pending = _Record(level if level is not None else logging.DEBUG, [line])

    @staticmethod
    def _continues(record: _Record, line: str) -> bool:
        """A warning's source line, a traceback and its last line belong to the record above them."""
        if line.startswith("Traceback (most recent call last)"):
            record.in_traceback = True
            return True
        if line[:1].isspace() and line.strip():
            return True
        if record.in_traceback and line.strip():  # "ValueError: ...": the traceback's last line
            record.in_traceback = False
            return True
        return False

    def _finish(self, state: _File) -> None:
        record, state.pending = state.pending, None
        text = "\n".join(record.lines)
        if not text.strip():
            return
        console = console_state()
        if record.level < logging.WARNING and not console.verbose:
            return
        dependency = not _MEGARL_RECORD.search(record.lines[0])
        if not console.admit(text, record.level, dependency):
            return  # counted: known, or a repeat (the worker's own file has it)
        logging.getLogger(f"{WORKER_LOGGER}.{state.path.stem}").log(
            max(record.level, logging.INFO), "%s", text, extra={"admitted": True})
