"""The driver watches its workers' processes while it waits for them: a dead rank is named in seconds.

Ray reports an actor dead when the actor's connection closes. A worker killed while a process it
forked still held that connection (megatron's checkpoint writers) looked alive to Ray until the
connection's keepalive ran out: the driver waited 460 s for a rank that had died at once (measured;
other kills surfaced in 8-16 s). ``platform.forks`` now takes such children down with the rank; this
watch does not depend on it: while the driver waits (``ProcessWatch.wait``, which ``WorkerGroup``
uses instead of ``ray.get``) it looks at the processes themselves every ``WATCH_PERIOD_S``: by pid
and start time (a reused pid is not the worker; ``platform.processes``) on the driver's node, through a small probe actor
(no CPU) on each other node. A dead one raises ``WorkerDied`` naming the rank, its pid and node and
what it was doing; ``timeout_s`` bounds a wait (a checkpoint save: ``trainer.save_timeout_s``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from megarl.platform.processes import identity, running

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 2.0


class WorkerDied(RuntimeError):
    """A worker process of the group is gone; ``logs`` names the dead ranks' files under the run's logs/."""

    def __init__(self, message: str, logs: Sequence[str] = ()):
        super().__init__(message)
        self.logs = list(logs)


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start: float  # seconds after boot (platform.processes)
    node_id: str
    node_ip: str


def this_process() -> ProcessIdentity:
    """Called inside a worker: who it is and where."""
    import ray

    pid, start = identity()
    return ProcessIdentity(pid, start, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def is_gone(pid: int, start: float) -> bool:
    """True when no process runs under ``pid`` with that start time (it ended, or a new one took the pid)."""
    return running(pid, start) is None


class NodeProbe:
    """A Ray actor on one node that checks processes of that node for the driver."""

    def gone(self, processes: list[tuple[int, float]]) -> list[bool]:
        return [is_gone(pid, start) for pid, start in processes]


class ProcessWatch:
    """The processes of a group's ranks (``label``: "trainer" names them "trainer rank 3")."""

    def __init__(self, processes: Sequence[ProcessIdentity], label: str):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.processes, self.label = list(processes), label
        self._here = ray.get_runtime_context().get_node_id()
        probe_cls = ray.remote(num_cpus=0)(NodeProbe)
        self._probes = {node: probe_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                                                ).remote()
                        for node in sorted({p.node_id for p in self.processes} - {self._here})}

    def dead(self) -> list[int]:
        """The ranks whose process is gone (a node whose probe does not answer counts as unknown)."""
        import ray

        ranks = [r for r, p in enumerate(self.processes) if p.node_id == self._here and is_gone(p.pid, p.start)]
        for node, probe in self._probes.items():
            on_node = [r for r, p in enumerate(self.processes) if p.node_id == node]
            try:
                gone = ray.get(probe.gone.remote([(self.processes[r].pid, self.processes[r].start)
                                                  for r in on_node]), timeout=10 * WATCH_PERIOD_S)
            except Exception as exc:  # noqa: BLE001 - the node may be gone; Ray reports that itself
                logger.warning("the process probe on node %s did not answer: %s", node, exc)
                continue
            ranks += [r for r, g in zip(on_node, gone) if g]
        return sorted(ranks)

    def wait(self, refs: list, what: str, timeout_s: float | None = None,
             ranks: Sequence[int] | None = None) -> list:
        """``ray.get(refs)``, raising ``WorkerDied`` as soon as a rank's process is gone and ``TimeoutError``
        after ``timeout_s``; ``ranks`` (default: all) are the ranks whose results ``refs`` are."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=WATCH_PERIOD_S)
            if not pending:
                try:
                    return ray.get(refs)
                except ray.exceptions.RayActorError as exc:  # ActorDiedError, ActorUnavailableError
                    dead = self.dead()  # Ray saw it first: the same message as when the watch does
                    if dead:
                        raise WorkerDied(self._describe(dead, what), self._logs(dead)) from exc
                    raise
            dead = self.dead()
            if dead:
                raise WorkerDied(self._describe(dead, what), self._logs(dead))
            if deadline is not None and time.monotonic() > deadline:
                ids = list(ranks) if ranks is not None else list(range(len(refs)))
                late = [ids[i] for i, ref in enumerate(refs) if ref in pending]
                raise TimeoutError(f"{what}: {self.label} rank(s) {late} did not finish within {timeout_s:g} s")

    def _describe(self, dead: list[int], what: str) -> str:
        parts = [f"{self.label} rank {r} (pid {self.processes[r].pid} on {self.processes[r].node_ip})" for r in dead]
        logs = ", ".join(self._logs(dead))
        return (f"{' and '.join(parts)} died while running {what}; its output is in {logs} under the run's logs/ "
                "(a process killed from outside, e.g. by the kernel's out-of-memory killer, leaves no traceback)")

    def _logs(self, dead: list[int]) -> list[str]:
        return [f"{self.label}_rank{r}.log" for r in dead]

    def close(self) -> None:
        import ray

        for probe in self._probes.values():
            ray.kill(probe, no_restart=True)
        self._probes = {}
