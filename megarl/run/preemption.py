"""Preemption: SIGTERM, or Slurm's ``--signal`` warning (SIGUSR1), while training steps run means "save,
then stop" (``trainer.save_on_preempt``, on by default).

    preemption = Preemption(enabled=True)      # held by the InterruptGuard, read by the training loop
    with preemption.armed():                   # around the training steps only
        for step in ...:
            ...train, log, save...
            signum = preemption.requested      # at the step boundary
            if signum is not None: save the step (unless just saved), then raise Interrupted(signum)

While armed, the guard's handler only records the first SIGTERM/SIGUSR1 (``defer``) and the step in
progress runs to its end; the loop then writes the checkpoint of that step through its normal, atomic
save and stops with the same exit code and report as an interrupt (143 for SIGTERM), so the same
command (or a requeued Slurm job, ``trainer.resume_mode=auto``) resumes from it. Outside the steps
(start-up, resume, the first validation, the summary) there is no step to finish: the signal interrupts
at once, as SIGINT always does (a terminal's Ctrl-C stops now, without a save). A second signal, more
than ``REPEAT_WINDOW_S`` after the first, still kills everything at once (``megarl.run.interrupts``).
"""
from __future__ import annotations

import contextlib
import signal

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's stop or its warning; not SIGINT (Ctrl-C)


class Preemption:
    """The request to save at the next step boundary and stop: ``requested`` is its signal, or None."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.requested: int | None = None
        self._armed = False

    @contextlib.contextmanager
    def armed(self):
        """While the training steps run, a preemption signal waits for the step boundary."""
        self._armed = True
        try:
            yield self
        finally:
            self._armed = False

    def defer(self, signum: int) -> bool:
        """Called by the signal handler for the first signal: True when it is recorded for the step
        boundary (armed, enabled, SIGTERM/SIGUSR1), False when the signal should interrupt at once."""
        if not (self.enabled and self._armed and signum in PREEMPT_SIGNALS):
            return False
        self.requested = signum
        return True

    def notice(self, signum: int) -> str:
        """What the handler prints when it defers a signal."""
        return (f"\n{signal.Signals(signum).name}: saving a checkpoint when the step in progress ends, then stopping "
                "(signal again to kill everything at once)\n")
