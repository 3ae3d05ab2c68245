"""The fleet's replicas by slot: which serve, which wait for their first weight sync, which are lost.

A slot is a replica's place in the fleet (its placement bundle or device slot) and keeps its index
for the fleet's life; the actor in it changes when a lost replica is replaced. States:

- ``serving``: takes requests, and is a member of the weight-sync world;
- ``joining``: a replacement started in a lost replica's slot; it is a member of the next sync
  world, and serves once a sync gave it the trainer's weights (``admit``), never before;
- ``lost``: its actor died, or its engine did (``ReplicaLost``); its requests went to the others.

``max_failures`` bounds the losses a run survives (``trainer.max_replica_failures``): the next one
raises ``ReplicaFailuresExceeded``, a clear stop instead of a fleet that keeps shrinking.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megarl.rollout.replica_base import ReplicaLost

logger = logging.getLogger(__name__)

SERVING, JOINING, LOST = "serving", "joining", "lost"


def split_evenly(count: int, parts: int) -> list[range]:
    """``count`` items as ``parts`` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class ReplicaFailuresExceeded(RuntimeError):
    """More replicas were lost than ``trainer.max_replica_failures`` allows; ``logs``: the last lost
    replica's log file under the run's logs/."""

    def __init__(self, message: str, logs: list[str]):
        super().__init__(message)
        self.logs = logs


def is_replica_lost(exc: BaseException) -> bool:
    """Does this error from a replica call mean the replica is gone (its actor or its engine died)?"""
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ReplicaLost))


@dataclass
class Replica:
    index: int  # the slot
    handle: Any  # the Ray actor handle
    state: str = SERVING
    generation: int = 0  # 0: the first actor of the slot; k: its k-th replacement


class ReplicaTable:
    def __init__(self, handles: list, max_failures: int | None = None):
        self.replicas = [Replica(i, handle) for i, handle in enumerate(handles)]
        self.max_failures = max_failures  # None: no bound (a fleet outside a training run)
        self.failures = 0
        self.last_failure = ""

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == SERVING]

    def members(self) -> list[Replica]:
        """The replicas in the weight-sync world and the control calls: serving and joining ones."""
        return [r for r in self.replicas if r.state != LOST]

    def lost(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == LOST]

    def membership(self) -> tuple:
        """Who is in the sync world now: changes when a replica is lost or replaced."""
        return tuple((r.index, r.generation) for r in self.members())

    def mark_lost(self, replica: Replica, reason: str) -> None:
        """Take ``replica`` out of service (once; a second report of the same loss is ignored)."""
        import ray

        if replica.state == LOST:
            return
        replica.state = LOST
        self.failures += 1
        self.last_failure = f"replica {replica.index}: {reason}"
        try:
            ray.kill(replica.handle)  # a replica whose engine died still holds its slot's resources
        except Exception:  # noqa: BLE001 - an actor that is already gone
            pass
        left = len(self.serving())
        logger.warning("rollout replica %d lost (%s); %d replica(s) still serving, %d loss(es) so far%s",
                       replica.index, reason, left, self.failures,
                       "" if self.max_failures is None else f" of at most {self.max_failures}")
        if self.max_failures is not None and self.failures > self.max_failures:
            raise ReplicaFailuresExceeded(
                f"{self.failures} rollout replica losses, more than trainer.max_replica_failures={self.max_failures}"
                f" allows; the last: {self.last_failure}. Look at that replica's log (rollout_replica"
                f"{replica.index}.log under the run's logs/), or raise trainer.max_replica_failures",
                [f"rollout_replica{replica.index}.log"])
        if not self.serving() and not any(r.state == JOINING for r in self.replicas):
            raise RuntimeError(f"every rollout replica is lost; the last: {self.last_failure}")

    def replaced(self, replica: Replica, handle: Any) -> None:
        """A new actor runs in a lost replica's slot; it joins the next sync world."""
        replica.handle, replica.state, replica.generation = handle, JOINING, replica.generation + 1

    def admit(self) -> list[int]:
        """The joining replicas received the trainer's weights: they serve from now on; their slots."""
        joined = [r for r in self.replicas if r.state == JOINING]
        for replica in joined:
            replica.state = SERVING
        if joined:
            logger.info("rollout replica(s) %s serve again, with the synced weights", [r.index for r in joined])
        return [r.index for r in joined]

    def next_serving(self, after: Replica) -> Replica:
        """The serving replica after ``after`` in slot order (wrapping): where its requests go."""
        serving = self.serving()
        if not serving:
            raise RuntimeError(f"no rollout replica is serving; the last loss: {self.last_failure}")
        return next((r for r in serving if r.index > after.index), serving[0])

    # ------------------------------------------------------------------ calls that route around losses
    def check_health(self, timeout_s: float) -> None:
        """Ask every member whether its engine is alive (``alive()``); one that is not, or does not answer
        within ``timeout_s``, is lost."""
        import ray

        members = self.members()
        refs = [r.handle.alive.remote() for r in members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for replica, ref in zip(members, refs):
            if ref not in ready:
                self.mark_lost(replica, f"no answer to the health check within {timeout_s:g} s")
                continue
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - only a lost replica is handled here
                if not is_replica_lost(exc):
                    raise
                self.mark_lost(replica, lost_cause(exc))

    def spread(self, method: str, count: int, args_of) -> list:
        """``count`` items in contiguous, equal-count chunks, one per serving replica; ``method(*args_of(chunk))``
        on each; the results in chunk order. A lost replica's chunk goes to the next serving one."""
        import ray

        chunks = [(chunk, replica) for chunk, replica in zip(split_evenly(count, len(self.serving())), self.serving())
                  if len(chunk)]
        pending = {getattr(replica.handle, method).remote(*args_of(chunk)): (k, replica)
                   for k, (chunk, replica) in enumerate(chunks)}
        results: list = [None] * len(chunks)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            k, replica = pending.pop(done[0])
            try:
                results[k] = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - a lost replica's chunk moves on; anything else is raised
                if not is_replica_lost(exc):
                    raise
                self.mark_lost(replica, lost_cause(exc))
                target = self.next_serving(replica)
                chunk = chunks[k][0]
                logger.warning("rollout: %s of items %d-%d moves from lost replica %d to replica %d", method,
                               chunk.start, chunk.stop - 1, replica.index, target.index)
                pending[getattr(target.handle, method).remote(*args_of(chunk))] = (k, target)
        return results


def lost_cause(exc: BaseException) -> str:
    """A lost replica's error in one line (Ray's actor-death message runs over many)."""
    text = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
