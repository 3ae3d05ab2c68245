"""Reward calls in worker processes that can be stopped: a call past its time limit kills its worker.

A reward function stuck in pure Python (a loop, a catastrophic regex, a slow symbolic comparison)
cannot be interrupted from another thread, and SIGALRM (verl's naive manager) reaches only the main
thread, between bytecodes, so not a regex stuck in C. ``RewardPool`` runs the calls in
``num_workers`` spawned processes instead: each worker gets a chunk of calls and sends every
outcome back as soon as it has it, so the parent knows which call each worker is on and since
when. A call running longer than ``timeout_s`` scores a timeout (``scoring.timeout_outcome``), its
worker is killed (SIGKILL) and replaced, and the rest of its chunk goes to the other workers. A
worker that dies on its own (a crash in a C extension) costs its current call an error, likewise.

The workers are started on first use and kept for the run (``close`` ends them); each loads the
reward function once (``RewardFunction`` pickles as its path and name).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import time
from collections import deque
from typing import Any, Callable

from megarl.rewards.scoring import score_batch, score_one, timeout_outcome


class RewardWorkerError(RuntimeError):
    """A reward worker process could not start."""


def _serve(conn, fn: Callable[..., Any]) -> None:
    """A worker: ``(None, "ready")`` once started, then chunks of ``(index, kind, item)`` in and one
    ``(index, outcome)`` per call out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's to handle
    conn.send((None, "ready"))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for index, kind, item in chunk:
            outcome = score_one(fn, *item) if kind == "sample" else score_batch(fn, item, {})
            try:
                conn.send((index, outcome))
            except Exception as exc:  # an extra value that cannot be pickled
                conn.send((index, ("error", f"the reward function's result cannot be sent back from its worker "
                                            f"process: {type(exc).__name__}: {exc}", "")))


class _Worker:
    def __init__(self, context, fn: Callable[..., Any]):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, fn), daemon=True, name="megarl-reward")
        self.process.start()
        child.close()
        self.ready = False  # started: the reward function is loaded (no call's time limit runs before)
        self.calls: deque[int] = deque()  # sent, not answered yet; the first is running
        self.since = 0.0  # when the running call started (the chunk's arrival or the last answer)

    def send(self, chunk: list[int], kind: str, items: list) -> None:
        self.calls.extend(chunk)
        self.since = time.monotonic()
        try:
            self.conn.send([(i, kind, items[i]) for i in chunk])
        except OSError:  # it died meanwhile: its first call fails as a crash (``_stop_if_stuck``)
            pass

    def answers(self) -> list[tuple]:
        """What it has sent back; marks it ready on its first message."""
        got = []
        while True:
            try:
                if not self.conn.poll():
                    return got
                index, outcome = self.conn.recv()
            except (EOFError, OSError):
                return got
            if index is None:
                self.ready = True
                continue
            got.append((index, outcome))
            self.calls.remove(index)
            self.since = time.monotonic()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class RewardPool:
    def __init__(self, fn: Callable[..., Any], num_workers: int, timeout_s: float | None):
        self.fn, self.num_workers, self.timeout_s = fn, int(num_workers), timeout_s
        self._context = multiprocessing.get_context("spawn")  # safe next to the parent's threads (Ray, torch)
        self._workers: list[_Worker] = []
        self.replaced = 0  # workers killed after a timeout or found dead, and started again

    def run(self, kind: str, items: list, done: Callable[[int], None] = lambda count: None) -> list[tuple]:
        """One outcome per item: ``kind="sample"`` items are samples (``score_one``), ``"batch"`` items
        are lists of samples for one batch-form call (their outcome is the list ``score_batch`` gives)."""
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._context, self.fn))
        size = max(1, -(-len(items) // (self.num_workers * 4)))
        queue = deque(range(len(items)))
        outcomes: list[Any] = [None] * len(items)
        while queue or any(w.calls for w in self._workers):
            for worker in self._workers:
                if worker.ready and not worker.calls and queue:
                    worker.send([queue.popleft() for _ in range(min(size, len(queue)))], kind, items)
            watched = [w for w in self._workers if w.calls or not w.ready]
            ready = multiprocessing.connection.wait([w.conn for w in watched] + [w.process.sentinel for w in watched],
                                                    timeout=self._wait_s([w for w in watched if w.calls]))
            for worker in watched:
                answered = worker.answers() if worker.conn in ready else []
                for index, outcome in answered:
                    outcomes[index] = outcome
                done(len(answered))
                self._stop_if_stuck(worker, kind, items, outcomes, queue, done)
        return outcomes

    def _wait_s(self, busy: list[_Worker]) -> float | None:
        if not self.timeout_s or not busy:
            return None
        return max(0.0, min(w.since for w in busy) + self.timeout_s - time.monotonic())

    def _stop_if_stuck(self, worker: _Worker, kind: str, items: list, outcomes: list, queue: deque,
                       done: Callable[[int], None]) -> None:
        """A worker past its call's time limit is killed, one that died is buried: its call fails, the
        calls it had not started go back to the queue, a new worker takes its place."""
        if not worker.ready and not worker.process.is_alive():
            raise RewardWorkerError(
                f"a reward worker process could not start (exit code {worker.process.exitcode}; its error is above or "
                "in the driver's log): workers are spawned, so the entry script needs an `if __name__ == "
                "'__main__':` guard and the reward function must load in a fresh interpreter. "
                "reward.compute_score_timeout=null with reward.num_workers=1 scores in this process, without a limit")
        if not worker.calls:
            return
        timed_out = bool(self.timeout_s) and time.monotonic() - worker.since > self.timeout_s
        if not timed_out and worker.process.is_alive():
            return
        index = worker.calls.popleft()
        if timed_out:
            outcome = timeout_outcome(self.timeout_s, " (its worker process was killed)")
        else:
            outcome = ("error", f"the reward worker process died (exit code {worker.process.exitcode}) on this "
                                "sample: the reward function crashed the interpreter", "")
        outcomes[index] = [outcome] * len(items[index]) if kind == "batch" else outcome
        queue.extendleft(reversed(worker.calls))
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._context, self.fn)
        self.replaced += 1
        done(1)

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(2)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []
