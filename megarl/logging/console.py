"""The driver's console: a few lines a person reads, everything else in log files.

    state = setup_console("INFO")           # before anything logs; "DEBUG" (--verbose) shows everything
    attach_log_file(run_dir / "logs" / "driver.log")
    say("rollout: %d replica(s) x TP=%d", 2, 4)  # a line meant for the console
    print(state.suppressed_line())          # "suppressed 23 known dependency warnings (...)"

What reaches the console (``trainer.log_level``, or ``--verbose`` for ``DEBUG``):

* ``INFO`` (default): lines written with ``say`` (the ``megarl.console`` logger: start-up facts,
  validation, checkpoints, progress, the summary), and warnings and errors from anything. A
  dependency's warning that ``known_messages`` lists is counted, not shown; any other
  dependency warning is shown once and its repeats are counted (the same text from every rank
  is one message). megarl's own warnings always show.
* ``DEBUG``: every record at INFO and above, nothing suppressed, and every line of the workers'
  log files (``megarl.logging.worker_logs``).
* ``WARNING``: warnings and errors only (the metrics sink still prints its step lines).

The log file gets every record at INFO and above, with timestamps, whatever the console shows.
Python warnings are routed through logging (``py.warnings``), so the same rules apply to them.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import TextIO

from megarl.logging.known_messages import known_name

CONSOLE_LOGGER = "megarl.console"
WORKER_LOGGER = "megarl.workers"  # lines read from the workers' log files: megarl.workers.<worker>
LOG_LEVELS = ("DEBUG", "INFO", "WARNING")  # trainer.log_level
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_console = logging.getLogger(CONSOLE_LOGGER)


def say(message: str, *args) -> None:
    """Print a line on the console (and into the log file): the messages a person running megarl reads."""
    _console.info(message, *args)


def check_log_level(value: str) -> str | None:
    """A problem with ``trainer.log_level=value``, or None."""
    if str(value).upper() not in LOG_LEVELS:
        return (f"trainer.log_level={value!r}: use INFO (default: a quiet console), DEBUG (everything, as "
                f"--verbose) or WARNING (warnings, errors and the step lines)")
    return None


class ConsoleState:
    """What the console held back: known dependency messages by name, and repeats of shown ones."""

    def __init__(self, level: str = "INFO"):
        self.level = level
        self.known: Counter[str] = Counter()
        self.repeats = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._reported = 0

    @property
    def verbose(self) -> bool:
        return self.level == "DEBUG"

    def admit(self, text: str, level: int, dependency: bool) -> bool:
        """Whether a warning (or worse) with this text goes to the console; counts what does not."""
        if self.verbose or level < logging.WARNING:
            return True
        name = known_name(text)
        with self._lock:
            if name is not None and dependency:
                self.known[name] += 1
                return False
            if not dependency:  # megarl's own warnings show every time
                return True
            key = _normalise(text)
            if key in self._seen:
                self.repeats += 1
                return False
            self._seen.add(key)
            return True

    def suppressed_line(self, since_last: bool = False) -> str | None:
        """One line naming what was held back (all of it, or what is new since the last report)."""
        with self._lock:
            total = sum(self.known.values())
            if since_last and total == self._reported:
                return None
            self._reported = total
            if not total and not self.repeats:
                return None
            parts = [f"{name} x{count}" for name, count in self.known.most_common()]
            text = f"suppressed {total} known dependency warning{'s' if total != 1 else ''}"
            if parts:
                text += f" ({', '.join(parts)})"
            if self.repeats:
                text += f" and {self.repeats} repeat{'s' if self.repeats != 1 else ''}"
            return text + "; --verbose (trainer.log_level=DEBUG) shows them"


def _normalise(text: str) -> str:
    """The same message from another rank, process or time: digits and hex ids do not count."""
    return re.sub(r"0x[0-9a-f]+|\d+", "#", text.strip())


class _ConsoleFilter(logging.Filter):
    def __init__(self, state: ConsoleState):
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        state = self.state
        is_console = record.name == CONSOLE_LOGGER or record.name.startswith(CONSOLE_LOGGER + ".")
        if state.level == "WARNING" and record.levelno < logging.WARNING:
            return False
        if state.level == "INFO" and record.levelno < logging.WARNING and not is_console:
            return False
        if getattr(record, "admitted", False):  # a worker line the follower let through already
            return True
        return state.admit(record.getMessage(), record.levelno, not record.name.startswith("megarl"))


class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name == CONSOLE_LOGGER:
            text = message
        elif record.name.startswith(WORKER_LOGGER + "."):
            text = f"[{record.name[len(WORKER_LOGGER) + 1:]}] {message}"
        else:
            text = f"{record.levelname} {record.name}: {message}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


_state: ConsoleState | None = None
_handler: logging.Handler | None = None  # the console handler setup_console installed
_file_handler: logging.Handler | None = None  # the log file attach_log_file installed


def setup_console(level: str = "INFO", stream: TextIO | None = None) -> ConsoleState:
    """Route every log record and Python warning of this process through the console rules."""
    global _state, _handler
    level = level.upper()
    if check_log_level(level):
        raise ValueError(check_log_level(level))
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    for handler in list(root.handlers):  # basicConfig's (a test harness's own handlers stay)
        if type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    _state = ConsoleState(level)
    _handler = logging.StreamHandler(stream or sys.stderr)
    _handler.addFilter(_ConsoleFilter(_state))
    _handler.setFormatter(_ConsoleFormatter())
    root.addHandler(_handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    adopt_library_loggers()
    return _state


def set_level(level: str) -> ConsoleState:
    """Change what the console shows (``trainer.log_level``, known only once the config is read)."""
    state = console_state()
    problem = check_log_level(level)
    if problem:
        raise ValueError(problem)
    state.level = level.upper()
    adopt_library_loggers()
    return state


def console_state() -> ConsoleState:
    """The console's state; without ``setup_console`` (a library use, a test) records go to whatever
    handlers the process has, and this state only counts what the worker-log follower holds back."""
    global _state
    if _state is None:
        _state = ConsoleState("INFO")
    return _state


def attach_log_file(path: str | Path) -> Path:
    """Also write every record (INFO and above, with timestamps) to ``path``; appends across runs."""
    global _file_handler
    detach_log_file()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _file_handler = logging.FileHandler(path, encoding="utf-8")
    _file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
    _file_handler.setLevel(logging.INFO)
    root = logging.getLogger()
    root.addHandler(_file_handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return path


def detach_log_file() -> None:
    """Stop writing the file ``attach_log_file`` opened (the end of a run)."""
    global _file_handler
    if _file_handler is not None:
        logging.getLogger().removeHandler(_file_handler)
        _file_handler.close()
        _file_handler = None


def adopt_library_loggers() -> None:
    """Make libraries that print through handlers of their own (Ray, transformers, ...) follow the rules.

    Their stream handlers go and their records propagate to the root logger's handlers; call it
    again after importing or starting one (``ray.init`` sets up Ray's). transformers' own progress
    bars are shown only when everything is (``DEBUG``).
    """
    for name, lib_logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(lib_logger, logging.Logger) or name.startswith("megarl"):
            continue
        streams = [h for h in lib_logger.handlers
                   if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
        for handler in streams:
            lib_logger.removeHandler(handler)
        if streams:
            lib_logger.propagate = True
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        verbose = _state is not None and _state.verbose
        (hf_logging.enable_progress_bar if verbose else hf_logging.disable_progress_bar)()
