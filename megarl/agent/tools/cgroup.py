"""A memory cgroup per sandbox call: all the processes of one call share one memory limit.

``RLIMIT_AS`` bounds each process, and a call may start up to ``max_processes`` of them, so by
rlimits alone a call could hold ``max_processes x memory_mb`` (32 x 512 MiB = 16 GiB). Where the
host lets this process create cgroups (root, and a writable memory controller: cgroup v1's memory
hierarchy, or cgroup v2 with ``memory`` delegated to this process's cgroup), every call runs in a
child cgroup of this process's own whose memory (and swap) is limited to ``memory_mb``: when the
call's processes together exceed it, the kernel's OOM killer ends the largest of them. Where the
host does not (``memory_cgroups()`` is None), ``megarl.agent.tools.sandbox`` bounds the total with
fewer processes instead.
"""
from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_CALLS = itertools.count()


@dataclass(frozen=True)
class MemoryCgroups:
    """Where this process's memory cgroup is, and which interface it speaks (1 or 2)."""

    parent: Path
    version: int

    def limit_files(self, limit: int) -> dict[str, str]:
        if self.version == 2:
            return {"memory.max": str(limit), "memory.swap.max": "0"}
        return {"memory.limit_in_bytes": str(limit), "memory.memsw.limit_in_bytes": str(limit)}

    def oom_kills(self, folder: Path) -> int:
        """OOM kills inside ``folder`` (v1: memory.oom_control, v2: memory.events)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            lines = (folder / name).read_text().splitlines()
        except OSError:
            return 0
        counts = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
        return int(counts.get("oom_kill", 0))


def _own_cgroup() -> tuple[Path, int] | None:
    """This process's memory cgroup directory and its version, from /proc/self/{cgroup,mountinfo}."""
    try:
        membership = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in membership:
        _, controllers, path = line.split(":", 2)
        paths["v2" if controllers == "" else controllers] = path
    for line in mounts:
        fields = line.split()
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        if fstype == "cgroup" and "memory" in options:
            key = next((k for k in paths if "memory" in k.split(",")), None)
            if key is not None:
                return Path(fields[4] + paths[key]), 1
        if fstype == "cgroup2" and "v2" in paths:
            folder = Path(fields[4] + paths["v2"])
            try:
                if "memory" in (folder / "cgroup.controllers").read_text().split():
                    return folder, 2
            except OSError:
                continue
    return None


@lru_cache(maxsize=1)
def memory_cgroups() -> MemoryCgroups | None:
    """The host's memory cgroups if this process can make limited child cgroups there, else None."""
    found = _own_cgroup()
    if found is None:
        return None
    cgroups = MemoryCgroups(*found)
    try:
        with CallCgroup(cgroups, 64 << 20):
            return cgroups
    except OSError:
        return None


class CallCgroup:
    """A child cgroup with a memory limit, for one call; ``join_command`` runs a command inside it."""

    def __init__(self, cgroups: MemoryCgroups, limit_bytes: int):
        self.cgroups = cgroups
        self.folder = cgroups.parent / f"megarl-sandbox-{os.getpid()}-{next(_CALLS)}"
        if cgroups.version == 2:
            (cgroups.parent / "cgroup.subtree_control").write_text("+memory")
        self.folder.mkdir()
        try:
            for name, value in cgroups.limit_files(limit_bytes).items():
                if (self.folder / name).exists():  # swap accounting may be off (no memsw / swap files)
                    (self.folder / name).write_text(value)
        except OSError:
            self.close()
            raise

    def join_command(self, command: list[str]) -> list[str]:
        """``command`` started by a shell that first moves itself into this cgroup (then execs it)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.folder), *command]

    def oom_killed(self) -> bool:
        return self.cgroups.oom_kills(self.folder) > 0

    def close(self) -> None:
        """Kill whatever is left in the cgroup and remove it."""
        for _ in range(100):
            try:
                pids = [int(p) for p in (self.folder / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.folder.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # busy until the killed processes are gone
                time.sleep(0.05)

    def __enter__(self) -> "CallCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
