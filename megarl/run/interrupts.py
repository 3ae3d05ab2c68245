"""Ctrl-C and SIGTERM: the run stops in order and says where it stands; a second one kills at once.

    guard = InterruptGuard(on_kill=remove_temp_dirs).install()   # again after ray.init, which sets its own
    try:
        run ...
    except KeyboardInterrupt as exc:      # raised in the main thread by the first signal
        print(interrupt_report(cfg.trainer, guard.interrupted(exc)))   # "interrupted at step 7 of 120; ..."
    finally:
        guard.restore()

The first SIGINT, SIGTERM or SIGUSR1 (Slurm's ``--signal`` warning) raises ``Interrupted`` (a
``KeyboardInterrupt``, so no ``except Exception`` swallows it) wherever the driver is; the
``finally`` blocks of the entry point then stop the engines and workers and remove the Ray
cluster's temp dir, exactly as at the end of a run. The workers block SIGINT
(``worker_logs.capture_worker_output``), so a terminal's Ctrl-C, which reaches the whole process
group, leaves the shutting-down to the driver. A second signal
during that teardown kills every process the run started (SIGKILL), removes the temp dirs and
exits at once. A signal within ``REPEAT_WINDOW_S`` (1 s) of the first is the same request sent
twice, not a second one: GNU ``timeout`` (and other supervisors) sends SIGTERM to the driver and
then to its whole process group, which reaches the driver again microseconds later. What the interrupted code leaves behind (a coroutine it never awaited, an object
half built when the exception arrived, such as an asyncio event loop whose ``__del__`` fails at
exit) goes to the log, not the console: it is the interrupt's trace, not a new failure.

While the training steps run, the first SIGTERM or SIGUSR1 instead asks for a checkpoint of the step in
progress and a stop at its end (``trainer.save_on_preempt``, ``megarl.run.preemption``); SIGINT always
interrupts at once.

``finished_run`` tells, before Ray starts, whether the checkpoint a run would resume from is its
last step already.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from megarl.run.preemption import Preemption
from megarl.trainer.checkpointing import checkpoint_step, latest_checkpoint_step

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
REPEAT_WINDOW_S = 1.0  # a signal this soon after the first is a duplicate (``timeout``'s pid + group), not a second one


class Interrupted(KeyboardInterrupt):
    """The run was interrupted; the entry point fills in the step in progress for the report."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.step: int | None = None
        self.total_steps: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1


class _InterruptedTasks(logging.Filter):
    """asyncio logs "Task exception was never retrieved" for a task the interrupt was raised in (an
    agent-loop rollout); that is the interrupt itself, not a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], Interrupted))


_TASKS_FILTER = _InterruptedTasks()


class InterruptGuard:
    """Turns the first SIGINT/SIGTERM/SIGUSR1 into ``Interrupted`` (or, for SIGTERM/SIGUSR1 while the steps
    run, into a request to save and stop at the step boundary: ``preemption``); the second kills the run's
    processes."""

    def __init__(self, on_kill: Callable[[], None] | None = None, preemption: Preemption | None = None):
        self.on_kill = on_kill
        self.preemption = preemption if preemption is not None else Preemption(enabled=False)
        self.received: int | None = None
        self.received_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}

    def install(self) -> "InterruptGuard":
        """Install (or re-install, e.g. after ``ray.init`` replaced the SIGTERM handler) the handlers."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                previous = signal.signal(sig, self._handle)
                if previous is not self._handle:
                    self._previous.setdefault(sig, previous)
        logging.getLogger("asyncio").addFilter(_TASKS_FILTER)  # once: filters are a set
        return self

    def interrupted(self, exc: KeyboardInterrupt) -> Interrupted:
        """The ``Interrupted`` a ``KeyboardInterrupt`` stands for: Ray's ``get`` turns the exception our
        handler raises into a plain ``KeyboardInterrupt`` (it checks for signals in its C++ wait loop)."""
        if isinstance(exc, Interrupted):
            return exc
        return Interrupted(self.received if self.received is not None else signal.SIGINT)

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
            if self.preemption.defer(signum):  # the loop saves this step, then raises Interrupted itself
                _write(self.preemption.notice(signum))
                return
            _write(f"\n{signal.Signals(signum).name}: stopping the engines and workers "
                   "(interrupt again to kill everything at once)\n")
            quiet_leftovers()
            raise Interrupted(signum)
        if time.monotonic() - self.received_at < REPEAT_WINDOW_S:
            return  # the first signal again (``timeout`` signals the driver, then its process group)
        self.kill_now(signum)

    def kill_now(self, signum: int) -> None:
        _write(f"{signal.Signals(signum).name} again: killing the run's processes\n")
        kill_descendants()
        if self.on_kill is not None:
            try:
                self.on_kill()
            except Exception:  # exiting regardless
                pass
        os._exit(128 + signum)


def quiet_leftovers() -> None:
    """From the first interrupt on (the process is on its way out, so nothing is put back):
    "coroutine ... was never awaited" warnings and exceptions raised in ``__del__`` (Python's
    "Exception ignored in ...") are logged, not printed."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
    sys.unraisablehook = _log_unraisable


def _log_unraisable(unraisable) -> None:
    try:
        logging.getLogger(__name__).info("after the interrupt, ignored in %r: %s: %s", unraisable.object,
                                         type(unraisable.exc_value).__name__, unraisable.exc_value)
    except Exception:  # at interpreter exit logging may be gone
        pass


def _write(text: str) -> None:
    """From a signal handler: straight to the file descriptor (logging may hold its lock)."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


def kill_descendants() -> None:
    """SIGKILL every process this one started, and theirs (Ray's daemons and workers, vLLM's engines)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=5)


def finished_run(trainer, root: str | Path, total_steps: int, critic: bool = False) -> tuple[int, Path] | None:
    """(step, checkpoint) when the checkpoint this run would resume from already holds its last step."""
    from megarl.trainer.resume import find_resume_checkpoint

    if trainer.val_only:
        return None
    found = find_resume_checkpoint(trainer, root, critic)
    if found is None:
        return None
    step = checkpoint_step(found[0])
    return (step, found[0]) if step is not None and step >= total_steps else None


def interrupt_report(trainer, exc: Interrupted) -> str:
    """What an interrupted run says: where it stopped, its last checkpoint, what the same command does."""
    step, total = exc.step, exc.total_steps
    where = "during start-up" if not step else f"at step {step}" + (f" of {total}" if total else "")
    last = latest_checkpoint_step(trainer.default_local_dir)
    if trainer.resume_mode == "disable":
        then = "the same command starts over (trainer.resume_mode=disable)"
    elif trainer.resume_mode == "resume_path" and last is not None:
        then = (f"the same command resumes from trainer.resume_from_path={trainer.resume_from_path}; "
                f"trainer.resume_from_path={last[1]} continues from the last checkpoint")
    elif last is not None:
        then = "the same command resumes"
    else:
        then = f"no checkpoint yet (trainer.save_freq={trainer.save_freq}): the same command starts over"
    saved = f"last checkpoint: step {last[0]} at {last[1]}; " if last is not None else ""
    return f"interrupted ({exc.name}) {where}; {saved}{then}"
