"""The groups between the rollout producer and the trainer, with the staleness bound applied.

Thread-safe: the producer (its own thread) admits groups and completes them; the training loop
takes them. ``admit`` may start a group only while ``staleness.StalenessBound.capacity`` allows;
``take(count, step_index)`` blocks until ``staleness.pick`` finds a feasible set of finished groups
(under ``drop``, groups past their deadline are dropped first and their slots refilled). Every wait
is bounded (``timeout_s``) and a producer failure is raised in the taker.

Counters for the metrics: ``taken``, ``dropped`` (past their deadline, ``drop``), ``filtered``
(discarded by the trainer, e.g. DAPO's all-equal groups), ``running``, ``finished`` (waiting to be
taken), ``most_ahead`` (the most groups admitted and not yet taken at once, since ``start``),
``trainer_wait_s`` of the last take.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from megarl.algorithms.staleness import Candidate, StalenessBound, expired, pick


@dataclass
class Group:
    """One prompt's samples: admitted at ``version`` (the fleet's), finished when ``data`` is set."""

    key: int  # the prompt number: admission order
    version: int
    deadline: int
    item: Any  # the prompt (a PromptItem)
    position: int  # its dataset position (for a checkpoint)
    data: Any = None  # StepData of its n samples, once finished
    trajectories: list = field(default_factory=list)
    finished_at: float | None = None


class ProducerError(RuntimeError):
    """The rollout producer failed; the message has its error."""


class SampleBuffer:
    def __init__(self, bound: StalenessBound, timeout_s: float = 3600.0, on_change: Callable[[], None] | None = None):
        self.bound, self.timeout_s = bound, timeout_s
        self.on_change = on_change or (lambda: None)  # wakes the producer (capacity may have grown)
        self.lock = threading.Condition()
        self.groups: dict[int, Group] = {}
        self.fleet_version = 0
        self.window_base = self.step_base = 0
        self.taken = 0
        self.dropped = 0
        self.filtered = 0
        self.error: BaseException | None = None
        self.closed = False
        self.trainer_wait_s = 0.0
        self.most_ahead = 0

    # ------------------------------------------------------------------ producer side
    def capacity(self) -> int:
        with self.lock:
            return self.bound.capacity(self.fleet_version, self.taken, len(self.groups))

    def admit(self, key: int, item: Any, position: int) -> Group | None:
        """Register a new group at the current fleet version, if the bound allows one more."""
        with self.lock:
            if self.closed or self.bound.capacity(self.fleet_version, self.taken, len(self.groups)) < 1:
                return None
            group = Group(key, self.fleet_version, self.bound.deadline(self.fleet_version), item, position)
            self.groups[key] = group
            self.most_ahead = max(self.most_ahead, len(self.groups))
            return group

    def finish(self, key: int, data: Any, trajectories: list) -> None:
        with self.lock:
            group = self.groups.get(key)
            if group is None:  # dropped while it ran
                return
            group.data, group.trajectories, group.finished_at = data, trajectories, time.perf_counter()
            self.lock.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.error = error
            self.lock.notify_all()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    # ------------------------------------------------------------------ trainer side
    def start(self, fleet_version: int, step_index: int) -> None:
        """Counting starts here: the fleet serves ``fleet_version`` and the next step is ``step_index``
        (0-based); window ``fleet_version`` begins with it, as if the earlier ones had been full."""
        with self.lock:
            self.fleet_version = self.window_base = int(fleet_version)
            self.step_base = int(step_index)
            self.taken = self.window_base * self.bound.window_groups
            self.most_ahead = len(self.groups)

    def window(self, step_index: int) -> int:
        """The window (the version its weights start from) of 0-based training step ``step_index``."""
        return self.window_base + (step_index - self.step_base) // self.bound.sync_every

    def published(self, version: int) -> None:
        """The fleet now serves ``version``: more groups may start."""
        with self.lock:
            self.fleet_version = int(version)
        self.on_change()

    def take(self, count: int, step_index: int) -> list[Group]:
        """``count`` finished groups for 0-based training step ``step_index``, ordered by prompt number."""
        start = time.perf_counter()
        deadline = start + self.timeout_s
        with self.lock:
            while True:
                if self.error is not None:
                    raise ProducerError(f"the rollout producer failed: {self.error}") from self.error
                if self.bound.strategy == "drop":
                    self._drop(expired(self._candidates(), self.window(step_index)))
                chosen = pick(self._candidates(), count, self.taken, self.bound)
                if chosen is not None:
                    break
                if self.closed:
                    raise ProducerError("the sample buffer was closed while a step waited for groups")
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(
                        f"training step {step_index + 1} waited {self.timeout_s:.0f} s for {count} rollout groups "
                        f"({self._describe()}); the fleet is not producing: check the replicas' logs")
                self.lock.wait(timeout=min(left, 5.0))
            groups = [self.groups.pop(key) for key in sorted(chosen)]
            self.taken += count
            self.trainer_wait_s = time.perf_counter() - start
        self.on_change()
        return groups

    def discard(self, count: int) -> None:
        """``count`` taken groups were not trained (filtered out): their slots go back to the producer."""
        with self.lock:
            self.taken -= count
            self.filtered += count
        self.on_change()

    def _drop(self, keys: list[int]) -> None:
        for key in keys:
            del self.groups[key]
        if keys:
            self.dropped += len(keys)
            self.on_change()

    def _candidates(self) -> list[Candidate]:
        return [Candidate(g.key, g.deadline, g.data is not None) for g in self.groups.values()]

    def _describe(self) -> str:
        done = sum(g.data is not None for g in self.groups.values())
        return (f"{done} finished, {len(self.groups) - done} running, fleet version {self.fleet_version}, "
                f"{self.taken} taken")

    def counts(self) -> dict[str, int]:
        with self.lock:
            done = sum(g.data is not None for g in self.groups.values())
            return {"finished": done, "running": len(self.groups) - done, "taken": self.taken,
                    "dropped": self.dropped, "filtered": self.filtered, "most_ahead": self.most_ahead}

    def untrained(self) -> list[tuple[int, int]]:
        """(key, dataset position) of every admitted group not yet taken, in prompt order (a checkpoint)."""
        with self.lock:
            return [(k, self.groups[k].position) for k in sorted(self.groups)]
