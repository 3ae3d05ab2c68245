"""A process's identity (pid, start time) survives a change of the wall clock, and a reused pid is not it."""
import subprocess
import sys

import psutil
import pytest

from megarl.cluster.process_watch import is_gone
from megarl.cluster.run_reaper import running as reaper_running
from megarl.platform.processes import ended, identity, running, start_time

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux_only
def test_a_clock_step_does_not_make_a_live_process_look_gone(monkeypatch):
    """psutil's create_time() adds the kernel's boot time, which moves when NTP or a VM resume steps the
    wall clock: a CI run once saw all trainer ranks declared dead at once. The identity must not move."""
    import psutil._pslinux as pslinux

    me = identity()
    wall_clock_start = psutil.Process().create_time()
    booted = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: booted + 1.5)  # the clock stepped 1.5 s
    assert abs(psutil.Process().create_time() - wall_clock_start) > 1  # what fooled the old check
    assert start_time(me[0]) == me[1]
    assert running(*me) is not None and reaper_running(*me) is not None
    assert not is_gone(*me)


class _Process:
    def __init__(self, status, running=True):
        self._status, self._running = status, running

    def is_running(self):
        return self._running

    def status(self):
        if self._status is None:
            raise psutil.NoSuchProcess(1)
        return self._status


def test_a_zombie_a_process_being_reaped_and_a_vanished_one_have_ended():
    """State X ("dead", being reaped) once passed for running in a CI run; the run reaper's driver check and
    ``running`` share this one rule."""
    assert not ended(_Process(psutil.STATUS_SLEEPING)) and not ended(_Process(psutil.STATUS_RUNNING))
    for status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD, None):
        assert ended(_Process(status))
    assert ended(_Process(psutil.STATUS_SLEEPING, running=False))
    assert not ended(psutil.Process())


@pytest.mark.heavy  # starts a process
def test_an_ended_process_and_a_reused_pid_are_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ended = identity(child.pid)
    child.wait()
    assert is_gone(*ended) and running(*ended) is None
    with pytest.raises(psutil.NoSuchProcess):
        start_time(child.pid)
    pid, start = identity()
    assert is_gone(pid, start - 100)  # this pid, another start: a process that had the pid before


@pytest.mark.heavy  # starts a process
@linux_only
def test_the_start_time_is_the_kernels_and_a_name_with_spaces_and_parentheses_parses(tmp_path):
    exe = tmp_path / "odd ) name (x"
    exe.symlink_to(sys.executable)
    child = subprocess.Popen([str(exe), "-c", "import time; time.sleep(30)"])
    try:
        assert abs(start_time(child.pid) - (psutil.Process(child.pid).create_time() - psutil.boot_time())) < 0.02
        assert running(*identity(child.pid)) is not None
    finally:
        child.kill()
        child.wait()
