"""The staleness bound of asynchronous training: which prompt groups may start, and which train now.

Units. A *group* is one prompt with its ``rollout.n`` samples (GRPO's unit; it trains whole). A
*step* trains ``W = data.train_batch_size`` groups; the weights are published to the fleet every
``T = async_training.trigger_parameter_sync_step`` steps, and each publication is a *version*: the
steps ``[w*T, (w+1)*T)`` (window ``w``) train from version ``w``. A group's *version* is the one
that sampled its first token; its *staleness* is ``w - version`` for the window ``w`` it trains in.
The bound ``K = async_training.staleness_threshold`` (verl's, a float): at most ``K * T * W``
groups run ahead of the trainer, and no group trains more than ``ceil(K)`` versions after its first
token. (Counts start at the fleet version the producer starts from: 0, or the version a resumed run
syncs to; ``taken`` then counts as if every earlier window had been full.)

Admission (AReaL's rule): at fleet version ``f``, a new group may start while
``taken + untrained < (K + f + 1) * T * W`` (``taken``: groups handed to the trainer; ``untrained``:
admitted, running or finished, not yet taken). A group admitted at ``f`` must train by window
``f + ceil(K)``: its *deadline*.

Consumption (``pick``): a step takes finished groups earliest deadline first (then admission order);
with ``fifo`` (one-step-off) strictly the oldest groups, in prompt order, which is feasible by
construction.
Completion order is random, so a young group can finish before an old one; taking young ones while
old ones run could leave more old groups than a window holds when their deadline comes. So a pick
is *feasible* only if afterwards, for every deadline ``d``, the untrained groups due by ``d`` fit the
step slots left until the end of window ``d``: ``due(d) <= (d + 1) * T * W - taken``. Otherwise the
step waits for the old groups (``wait``, the default), or (``drop``) the groups past their deadline
are dropped and replaced. Admission keeps ``untrained <= (ceil(K) + f + 1) * T * W - taken``, so
once the old groups finish a feasible pick exists: waiting never deadlocks. With ``K = 0`` and
``T = 1`` a step trains exactly the ``W`` groups started after the last sync, in prompt order: the
synchronous loop's batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

STRATEGIES = ("wait", "drop")  # async_training.max_off_policy_strategy (verl: trainer.v1.sampler.*)


@dataclass(frozen=True)
class StalenessBound:
    threshold: float  # K, in versions
    batch_groups: int  # W
    sync_every: int = 1  # T
    strategy: str = "wait"
    fifo: bool = False  # take groups strictly in prompt order (one-step-off: batch k trains as batch k)

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.batch_groups < 1 or self.sync_every < 1 or self.strategy not in STRATEGIES:
            raise ValueError(f"staleness bound: threshold={self.threshold} (>= 0), batch_groups={self.batch_groups} "
                             f"(>= 1), sync_every={self.sync_every} (>= 1), strategy={self.strategy!r} {STRATEGIES}")

    @property
    def window_groups(self) -> int:
        return self.batch_groups * self.sync_every

    @property
    def max_lag(self) -> int:
        """The most versions a group may train after its first token."""
        return math.ceil(self.threshold)

    def capacity(self, fleet_version: int, taken: int, untrained: int) -> int:
        """How many more groups may start now."""
        limit = math.floor((self.threshold + fleet_version + 1) * self.window_groups + 1e-9)
        return max(0, limit - taken - untrained)

    def deadline(self, version: int) -> int:
        """The last window a group whose first token is of ``version`` may train in."""
        return version + self.max_lag


@dataclass(frozen=True)
class Candidate:
    key: int  # admission order (the group's prompt number)
    deadline: int
    done: bool


def pick(candidates: Sequence[Candidate], count: int, taken: int, bound: StalenessBound) -> list[int] | None:
    """The keys of ``count`` finished groups to train now (earliest deadline first), or None to wait.

    ``taken`` counts the groups trained before this pick; ``candidates`` are all untrained groups.
    Under ``wait`` a pick that would leave some deadline infeasible returns None; under ``drop``
    the caller drops expired groups first (``expired``) and any ``count`` finished groups do.
    """
    if bound.fifo:  # the oldest ``count`` groups, once all of them are finished
        oldest = sorted(candidates, key=lambda c: c.key)[:count]
        return [c.key for c in oldest] if len(oldest) == count and all(c.done for c in oldest) else None
    ready = sorted((c for c in candidates if c.done), key=lambda c: (c.deadline, c.key))
    if len(ready) < count:
        return None
    chosen = ready[:count]
    if bound.strategy == "wait" and not feasible(candidates, {c.key for c in chosen}, taken + count, bound):
        return None
    return [c.key for c in chosen]


def feasible(candidates: Sequence[Candidate], chosen: set[int], taken_after: int, bound: StalenessBound) -> bool:
    """After taking ``chosen``, every deadline's untrained groups fit the slots left until it."""
    left = sorted(c.deadline for c in candidates if c.key not in chosen)
    for due, deadline in enumerate(left, start=1):  # due: the groups with a deadline <= this one
        if due > (deadline + 1) * bound.window_groups - taken_after:
            return False
    return True


def expired(candidates: Sequence[Candidate], window: int) -> list[int]:
    """Keys of untrained groups whose deadline lies before ``window``."""
    return [c.key for c in candidates if c.deadline < window]
