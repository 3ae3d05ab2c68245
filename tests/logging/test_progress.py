"""Progress of long work: rate and ETA in a line every ``every_s``, nothing for short work."""
from __future__ import annotations

import logging
import time

from megarl.logging.progress import Progress, StepProgress, directory_bytes, duration, human


def test_lines_give_amount_rate_and_eta(monkeypatch):
    monkeypatch.setattr(Progress, "elapsed", property(lambda self: self.frozen_s))  # no clock drift on a loaded machine
    progress = Progress("validation", total=1000, unit="prompts", tty=False)
    progress.frozen_s = 10  # as if it began 10 s ago
    progress.set(250)
    assert progress.line() == "validation: 250/1,000 prompts (25%), 25 prompts/s, ETA 30 s (10 s so far)"
    progress.close()
    saving = Progress("checkpoint step 50", total=4 << 30, unit="B", tty=False)
    saving.frozen_s = 4
    saving.set(1 << 30)
    assert saving.line() == "checkpoint step 50: 1.0 GB/4.0 GB (25%), 256.0 MB/s, ETA 12 s (4.0 s so far)"
    saving.close()
    waiting = Progress("starting 8 trainer rank(s)", tty=False)
    waiting.frozen_s = 95
    assert waiting.line() == "starting 8 trainer rank(s): 1m35s so far"
    waiting.close()
    assert (human(1536, "B"), human(3, "engines"), duration(3725)) == ("1.5 kB", "3", "1h02m")


def test_nothing_done_yet_gives_the_time_only(monkeypatch):
    """Not 'starting 1 vllm engine(s): 0/1 engines (0%), 0 engines/s': the count and rate say nothing yet."""
    monkeypatch.setattr(Progress, "elapsed", property(lambda self: self.frozen_s))
    engines = Progress("starting 1 vllm engine(s)", total=1, unit="engines", tty=False)
    engines.frozen_s = 30
    assert engines.line() == "starting 1 vllm engine(s): 30 s so far"
    engines.close()


def test_training_steps_give_position_rate_tokens_and_eta():
    """A run resumed at step 10 of 40: rates count this process's steps and tokens only."""
    now = [100.0]
    progress = StepProgress(11, 40, clock=lambda: now[0])
    now[0] += 4
    assert progress.text(11, tokens=2000) == "11/40 (28%), 0.25 steps/s, 500 tok/s, ETA 1m56s"
    now[0] += 4
    assert progress.text(12, tokens=2000) == "12/40 (30%), 0.25 steps/s, 500 tok/s, ETA 1m52s"
    now[0] += 112
    assert progress.text(40) == "40/40 (100%), 0.25 steps/s, 33 tok/s"  # 4,000 tokens in 120 s


def test_periodic_lines_only_for_long_work_and_polled_amounts(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="megarl.console")
    with Progress("quick", total=10, tty=False, every_s=5.0) as quick:
        quick.update(10)
    (tmp_path / "part").write_bytes(b"x" * 1000)
    with Progress("long", total=2000, unit="B", poll=lambda: directory_bytes(tmp_path, tmp_path / "missing"),
                  every_s=0.2, poll_s=0.05, tty=False) as long:
        deadline = time.monotonic() + 10  # a loaded machine may schedule the watcher late
        while long.lines < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("quick" in m for m in messages)
    assert long.lines >= 2 and long.done == 1000
    assert all(m.startswith("  long: 1000 B/2.0 kB (50%), ") for m in messages), messages
