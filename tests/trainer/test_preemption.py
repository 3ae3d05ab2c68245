"""Preemption and restarts without processes: the signal's flag, the step boundary, the restart loop.

The real runs: tests/trainer/test_console_run.py (SIGTERM mid-step: the step's checkpoint, exit 143,
the rerun resumes from it) and tests/trainer/test_e2e.py (a trainer rank killed with
trainer.max_restarts=1: the run restarts from its checkpoint and equals an uninterrupted one)."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from megarl.cluster.process_watch import WorkerDied
from megarl.run.interrupts import Interrupted, InterruptGuard
from megarl.run.loop import TrainingLoop
from megarl.run.preemption import Preemption
from megarl.run.restarts import log_tail, prepare_restart, restart_line, run_with_restarts


def test_only_sigterm_and_sigusr1_during_the_steps_wait_for_the_boundary():
    preemption = Preemption(enabled=True)
    assert not preemption.defer(signal.SIGTERM)  # start-up: nothing to finish, interrupt at once
    with preemption.armed():
        assert not preemption.defer(signal.SIGINT)  # a terminal's Ctrl-C stops now
        assert preemption.requested is None
        assert preemption.defer(signal.SIGUSR1)  # Slurm's --signal=B:USR1@<secs> warning
    assert preemption.requested == signal.SIGUSR1
    off = Preemption(enabled=False)  # trainer.save_on_preempt=false: today's behaviour
    with off.armed():
        assert not off.defer(signal.SIGTERM)


def test_guard_records_a_sigterm_while_armed_and_still_interrupts_on_sigint():
    guard = InterruptGuard(preemption=Preemption(enabled=True)).install()
    try:
        with guard.preemption.armed():
            os.kill(os.getpid(), signal.SIGTERM)  # no exception: the step goes on
            assert guard.preemption.requested == signal.SIGTERM and guard.received == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)  # the same request again (timeout's pid + group): ignored
    finally:
        guard.restore()
    guard = InterruptGuard(preemption=Preemption(enabled=True)).install()
    try:
        with guard.preemption.armed(), pytest.raises(Interrupted) as raised:
            os.kill(os.getpid(), signal.SIGINT)
        assert raised.value.exit_code == 130 and guard.preemption.requested is None
    finally:
        guard.restore()
    assert Interrupted(signal.SIGUSR1).exit_code == 138


class FakeTrainer:
    """Just what ``TrainingLoop``'s steps touch; ``on_step`` runs inside a step (a signal arrives there)."""

    def __init__(self, total: int, on_step):
        self.total_steps, self.global_step, self.history, self.on_step = total, 0, [], on_step
        self.settings = SimpleNamespace(trainer=SimpleNamespace(max_consecutive_skipped_steps=3, val_only=False,
                                                                val_before_train=False, test_freq=-1, save_freq=2,
                                                                stale_weights_warn_threshold=None),
                                        verify_sync=False, asynchronous=None)
        self.val_dataset = None

    def train_step(self, step: int) -> dict:
        self.on_step(step)
        return {"actor/pg_loss": 0.1 * step}


def loop_with(trainer, preemption, restarts=0):
    logged, saved = [], []
    loop = TrainingLoop(trainer, SimpleNamespace(log=lambda metrics, step, **_: logged.append((step, dict(metrics)))),
                        "/nonexistent", plan=None)
    loop.resume = lambda: 0
    loop.save = saved.append
    loop.preemption, loop.restarts = preemption, restarts
    return loop, logged, saved


@pytest.mark.parametrize("signal_at,expected_saves", [(3, [2, 3]), (4, [2, 4])])
def test_a_signal_during_a_step_saves_that_step_then_stops(signal_at, expected_saves):
    """SIGTERM during step 3 (save_freq=2): step 3 ends, is saved, the run stops with 143; during step 4 (a
    save_freq step) it is saved once."""
    preemption = Preemption(enabled=True)
    guard = InterruptGuard(preemption=preemption).install()
    try:
        trainer = FakeTrainer(6, lambda step: step == signal_at and os.kill(os.getpid(), signal.SIGTERM))
        loop, logged, saved = loop_with(trainer, preemption, restarts=1)
        with pytest.raises(Interrupted) as raised:
            loop.run()
    finally:
        guard.restore()
    assert raised.value.exit_code == 143 and loop.step == signal_at
    assert saved == expected_saves
    assert [step for step, _ in logged] == list(range(1, signal_at + 1))  # the step in progress finished and was logged
    assert all(metrics["run/restarts"] == 1.0 for _, metrics in logged)


def test_without_a_signal_or_with_save_on_preempt_off_nothing_changes():
    trainer = FakeTrainer(5, lambda step: None)
    loop, logged, saved = loop_with(trainer, Preemption(enabled=True))
    loop.run()
    assert saved == [2, 4, 5] and [step for step, _ in logged] == [1, 2, 3, 4, 5]
    assert logged[0][1]["run/restarts"] == 0.0
    guard = InterruptGuard(preemption=Preemption(enabled=False)).install()
    try:
        trainer = FakeTrainer(6, lambda step: step == 3 and os.kill(os.getpid(), signal.SIGTERM))
        loop, logged, saved = loop_with(trainer, guard.preemption)
        with pytest.raises(Interrupted):
            loop.run()  # at once, inside step 3: no save of step 3
    finally:
        guard.restore()
    assert saved == [2] and [step for step, _ in logged] == [1, 2]


def test_worker_deaths_restart_at_most_max_restarts_times():
    calls, restarts_seen = [], []

    def attempt(restarts):
        calls.append(restarts)
        if len(calls) <= 2:
            raise WorkerDied("trainer rank 1 (pid 7 on 10.0.0.2) died while running update_actor", ["trainer_rank1.log"])
        return {"done": restarts}

    assert run_with_restarts(attempt, 2, lambda n, exc: restarts_seen.append(n)) == {"done": 2}
    assert calls == [0, 1, 2] and restarts_seen == [1, 2]
    calls.clear()
    with pytest.raises(WorkerDied):
        run_with_restarts(attempt, 1, lambda n, exc: None)
    assert calls == [0, 1]
    calls.clear()
    with pytest.raises(WorkerDied):
        run_with_restarts(attempt, 0, lambda n, exc: None)  # the default: the run stops
    calls.clear()
    with pytest.raises(WorkerDied):  # a worker that died after a SIGTERM (Slurm's reaches every process): no restart
        run_with_restarts(attempt, 2, lambda n, exc: None, stop_requested=lambda: True)
    assert calls == [0]
    with pytest.raises(ValueError):  # anything else would fail again: no restart
        run_with_restarts(lambda restarts: (_ for _ in ()).throw(ValueError("bug")), 3, lambda n, exc: None)


def test_restart_line_checkpoint_choice_and_log_tail(tmp_path, monkeypatch):
    import time

    from megarl.trainer import checkpointing

    exc = WorkerDied("trainer rank 0 (pid 42 on 127.0.0.1) died while running compute_log_probs; its output is in "
                     "trainer_rank0.log under the run's logs/ (...)", ["trainer_rank0.log"])
    step_4 = tmp_path / "actor" / "step_4"
    step_4.mkdir(parents=True)
    monkeypatch.setattr(checkpointing, "latest_checkpoint_step", lambda root: (4, step_4))
    trainer = SimpleNamespace(resume_mode="disable")
    assert prepare_restart(trainer, tmp_path, started=time.time() + 60) is None  # an older run's: start over again
    assert trainer.resume_mode == "disable"
    assert prepare_restart(trainer, tmp_path, started=time.time() - 60) == (4, step_4)  # this run's own save
    assert trainer.resume_mode == "auto"
    assert restart_line(1, 2, exc, (4, step_4)) == (
        "restart 1 of 2 (trainer.max_restarts): trainer rank 0 (pid 42 on 127.0.0.1) died while running "
        "compute_log_probs; starting the run again from the checkpoint of step 4")
    assert restart_line(1, 1, exc, None).endswith("starting the run again from the start (no checkpoint yet)")
    (tmp_path / "trainer_rank0.log").write_text("".join(f"line {i}\n" for i in range(30)))
    tail = log_tail(exc, tmp_path, lines=3)
    assert tail == f"last lines of {tmp_path / 'trainer_rank0.log'}:\n  line 27\n  line 28\n  line 29"
    assert log_tail(WorkerDied("x", ["missing.log"]), tmp_path) == ""
