"""Rate and ETA for long work: a bar on a terminal, a line every 30 s in a log, nothing for short work.

    with Progress("validation", total=len(dataset), unit="prompts") as progress:
        for batch in batches:
            ...
            progress.update(len(batch))

    # work that reports nothing itself: ``poll`` is asked for the amount done every 2 s
    with Progress("checkpoint step 50", total=expected_bytes, unit="B", poll=lambda: bytes_in(tmp_dir)):
        workers.call("save_checkpoint", ...)

On a terminal (stderr is a TTY) it is a tqdm bar that appears after ``bar_delay_s`` and
disappears when the work ends. Otherwise (a log file, Slurm's output) a line such as
``validation: 300/1000 prompts (30%), 12.5 prompts/s, ETA 56 s`` goes to the console logger
every ``every_s``, the first one after ``every_s``: work shorter than that prints nothing, and the
caller's own result line ("validation at step 20: ...") says how long it took. Without a total
the line gives the amount and the rate; before anything is done, only the time so far.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from megarl.logging.console import say


def human(amount: float, unit: str) -> str:
    if unit != "B":
        return f"{amount:,.0f}" if amount >= 10 or float(amount).is_integer() else f"{amount:.1f}"
    for scale, name in ((1 << 40, "TB"), (1 << 30, "GB"), (1 << 20, "MB"), (1 << 10, "kB")):
        if amount >= scale:
            return f"{amount / scale:.1f} {name}"
    return f"{amount:.0f} B"


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    def __init__(self, what: str, total: float | None = None, unit: str = "items", *,
                 poll: Callable[[], float] | None = None, every_s: float = 30.0, poll_s: float = 2.0,
                 bar_delay_s: float = 5.0, tty: bool | None = None):
        self.what, self.total, self.unit = what, total, unit
        self.done = 0.0
        self.start = time.monotonic()
        self.lines = 0  # periodic lines printed so far
        self._poll, self._every_s, self._poll_s = poll, every_s, poll_s
        self._stop = threading.Event()
        self._bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                             delay=bar_delay_s, leave=False, dynamic_ncols=True, file=sys.stderr)
        self._thread = threading.Thread(target=self._watch, name=f"progress: {what}", daemon=True)
        self._thread.start()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def update(self, amount: float = 1) -> None:
        self.set(self.done + amount)

    def set(self, done: float) -> None:
        self.done = float(done)
        if self._bar is not None:
            self._bar.n = self.done
            self._bar.refresh()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def line(self) -> str:
        """``what: done/total unit (x%), rate unit/s, ETA t`` (as much of it as is known)."""
        elapsed = self.elapsed
        rate = self.done / elapsed if elapsed > 0 else 0.0
        unit = "" if self.unit == "B" else f" {self.unit}"
        if not self.done:  # "0/1 engines (0%), 0 engines/s" says nothing the time does not
            return f"{self.what}: {duration(elapsed)} so far"
        if self.total:
            text = (f"{self.what}: {human(self.done, self.unit)}/{human(self.total, self.unit)}{unit} "
                    f"({100 * self.done / self.total:.0f}%)")
        else:
            text = f"{self.what}: {human(self.done, self.unit)}{unit}"
        text += f", {human(rate, self.unit)}{unit}/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f", ETA {duration((self.total - self.done) / rate)}"
        return text + f" ({duration(elapsed)} so far)"

    def _watch(self) -> None:
        next_line = self._every_s
        while not self._stop.wait(min(self._poll_s, self._every_s)):
            if self._poll is not None:
                try:
                    self.set(self._poll())
                except Exception:  # a poll that fails (a file vanished mid-walk) skips a beat
                    pass
            if self._bar is not None:
                self._bar.refresh()
            elif self.elapsed >= next_line:
                say("  %s", self.line())
                self.lines += 1
                next_line += self._every_s

    def close(self) -> float:
        """Stop; returns the seconds the work took."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        return self.elapsed


class StepProgress:
    """Where a training run stands, for its step lines: ``3/120 (2%), 0.42 steps/s, 1,234 tok/s, ETA 4m38s``.

    Rates count the steps this process ran (a resumed run's earlier steps took no time here) and the
    tokens they processed (``perf/total_num_tokens``); the first step (compile, warm caches) is in them."""

    def __init__(self, first_step: int, total_steps: int, clock: Callable[[], float] = time.monotonic):
        self.first_step, self.total_steps = first_step, total_steps
        self._clock = clock
        self._start = clock()
        self._tokens = 0.0

    def text(self, step: int, tokens: float = 0.0) -> str:
        """After ``step`` (which processed ``tokens``)."""
        self._tokens += tokens
        elapsed = max(self._clock() - self._start, 1e-9)
        done = step - self.first_step + 1
        rate = done / elapsed
        text = f"{step}/{self.total_steps} ({100 * step / max(self.total_steps, 1):.0f}%), {rate:.3g} steps/s"
        if self._tokens:
            text += f", {human(self._tokens / elapsed, 'tok')} tok/s"
        if step < self.total_steps:
            text += f", ETA {duration((self.total_steps - step) / rate)}"
        return text


def directory_bytes(*paths) -> int:
    """Bytes of the files under ``paths`` (missing ones count 0): how far a checkpoint write has come."""
    import os

    total = 0
    for path in paths:
        for root, _, files in os.walk(path):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:
                    pass
    return total
