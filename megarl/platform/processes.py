"""Which process a pid is: the pid and its start time, read so that a clock change cannot fool it.

A pid alone is not an identity (the kernel reuses pids), so megarl's process watch and run reaper
keep (pid, start time) and compare. ``psutil.Process.create_time()`` is not fit for that: it is the
start in jiffies since boot plus the boot time in wall-clock seconds, and the kernel's boot time
moves whenever the wall clock is stepped or slewed (NTP, a VM resumed from a snapshot). A CI run
saw every trainer rank of a job declared dead at once while all of them were running: the boot
time had moved by more than the comparison's tolerance. Here the start time is the kernel's own
count of clock ticks since boot (``/proc/<pid>/stat``, field 22), which never changes for a process;
on systems without ``/proc`` psutil's wall-clock start is the fallback.
"""
from __future__ import annotations

import os

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SAME_START_S = 0.5 / _CLOCK_TICKS  # the /proc start times are whole ticks: equal, or a different process


def start_time(pid: int) -> float:
    """Seconds after boot at which ``pid`` started; raises ``psutil.NoSuchProcess`` when there is none."""
    import psutil

    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from None
        return psutil.Process(pid).create_time()  # no /proc: wall-clock seconds, the best there is
    except OSError as exc:
        raise psutil.NoSuchProcess(pid) from exc
    fields = stat[stat.rindex(b")") + 2:].split()  # the name in parentheses may hold spaces
    return int(fields[19]) / _CLOCK_TICKS  # field 22 of the line; the 20th after the name


def identity(pid: int | None = None) -> tuple[int, float]:
    """(pid, start time) of ``pid``, default this process."""
    pid = os.getpid() if pid is None else pid
    return pid, start_time(pid)


def running(pid: int, start: float):
    """The ``psutil.Process`` running under ``pid`` that started at ``start``, or None (it ended, is a
    zombie or being reaped (state X, "dead": seen by a CI run), or the pid now belongs to another process)."""
    import psutil

    try:
        process = psutil.Process(pid)
        if abs(start_time(pid) - start) < _SAME_START_S and not ended(process):
            return process
    except psutil.Error:
        pass
    return None


def ended(process) -> bool:
    """Whether a ``psutil.Process`` has ended: gone, a zombie, or being reaped (state X, "dead")."""
    import psutil

    try:
        return not process.is_running() or process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True
