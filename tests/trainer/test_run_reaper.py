"""A dead driver's processes and temp dir are removed: by its reaper at once, or by the next run.

Real processes stand in for the cluster (no Ray here; ``test_run_processes.py`` kills real runs).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from megarl.cluster import run_reaper
from megarl.platform.processes import identity, start_time

REPO = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def stale_dir(directory: Path, driver: tuple[int, float], processes: list[subprocess.Popen]) -> Path:
    """A temp dir as a cluster leaves it: the driver's marker and the reaper's last record."""
    directory.mkdir()
    (directory / run_reaper.MARKER).write_text(json.dumps({"pid": driver[0], "start": driver[1]}))
    record = [identity(p.pid) for p in processes]
    (directory / run_reaper.RECORD).write_text(json.dumps(record))
    return directory


@pytest.mark.heavy  # starts a process
def test_the_next_run_removes_only_dead_runs_temp_dirs(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_driver = identity(gone.pid)
    gone.wait()
    me = psutil.Process()
    leftover, untouched, recycled = (subprocess.Popen(SLEEPER) for _ in range(3))
    try:
        dead = stale_dir(tmp_path / "ray_dead", gone_driver, [leftover])
        reused = stale_dir(tmp_path / "ray_reused", (me.pid, start_time(me.pid) - 100), [])  # the pid is another's now
        live = stale_dir(tmp_path / "ray_live", identity(me.pid), [untouched])
        other = stale_dir(tmp_path / "ray_other", gone_driver, [])
        record = json.loads((other / run_reaper.RECORD).read_text())
        (other / run_reaper.RECORD).write_text(json.dumps(record + [[recycled.pid, 1.0]]))  # same pid, other start
        foreign = tmp_path / "ray_foreign"
        foreign.mkdir()  # no marker: not a megarl cluster's
        removed = run_reaper.remove_stale_temp_dirs(str(tmp_path))
        assert sorted(removed) == sorted(map(str, [dead, reused, other]))
        assert live.exists() and foreign.exists()
        leftover.wait(timeout=10)  # the dead run's leftover went with its dir (psutil reaped it: no exit code)
        assert untouched.poll() is None and recycled.poll() is None  # a live run's, and a reused pid's, untouched
    finally:
        for process in (leftover, untouched, recycled):
            process.kill()
            process.wait()



WRITER = textwrap.dedent("""
    import itertools, os, sys, time
    log = open(os.path.join(sys.argv[1], "worker.log"), "w")
    for i in itertools.count():  # as a process whose TMPDIR is in the temp dir: it makes what it needs again
        os.makedirs(os.path.join(sys.argv[1], "tmp"), exist_ok=True)
        open(os.path.join(sys.argv[1], "tmp", f"socket-{i}"), "w").close()
        time.sleep(0.01)
""")


@pytest.mark.heavy  # starts a process
def test_a_process_started_after_the_last_record_goes_too(tmp_path):
    """The record is up to a second old: a process started since (a vLLM engine core whose worker was starting)
    is not in it, yet it holds a file in the temp dir and keeps creating others there (its TMPDIR). A CI run
    was left a half-removed temp dir by one. It is found by what it holds, killed, and the dir goes."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_driver = identity(gone.pid)
    gone.wait()
    dead = stale_dir(tmp_path / "ray_dead", gone_driver, [])
    (dead / "tmp").mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(dead)])
    try:
        deadline = time.monotonic() + 60
        while not (dead / "worker.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run_reaper.remove_stale_temp_dirs(str(tmp_path)) == [str(dead)]
        writer.wait(timeout=10)  # it loops forever: only the kill ends it (psutil reaped it: no exit code)
        assert not dead.exists()
    finally:
        writer.kill()
        writer.wait()

DRIVER = textwrap.dedent('''
    import subprocess, sys, tempfile, time
    import psutil
    from megarl.cluster import run_reaper

    temp_dir = tempfile.mkdtemp(prefix="ray_", dir=sys.argv[1])
    run_reaper.write_marker(temp_dir)
    reaper = run_reaper.start_reaper(temp_dir)
    # a raylet stand-in that dies with the driver, and its agent, which then leaves the driver's tree
    raylet = subprocess.Popen([sys.executable, "-c", "import ctypes, signal, subprocess, sys, time; "
                               "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                               "time.sleep(300)"])
    deadline = time.monotonic() + 60
    while not psutil.Process(raylet.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)
    agent = psutil.Process(raylet.pid).children()[0]
    # the reaper records the tree every second: wait until its record holds the agent (a loaded CI machine
    # can take longer than a fixed sleep to start the reaper)
    while agent.pid not in dict(run_reaper.read_record(temp_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(temp_dir, reaper.process.pid, raylet.pid, agent.pid, flush=True)
    time.sleep(300)
''')


@pytest.mark.heavy  # starts a process
def test_the_reaper_cleans_up_after_a_killed_driver(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    temp_dir, *pids = driver.stdout.readline().split()
    processes = [psutil.Process(int(pid)) for pid in pids]  # the reaper, the raylet and its agent
    try:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(processes, timeout=20)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], \
            f"left running after the driver was killed: {alive}"
        assert not Path(temp_dir).exists()
    finally:
        for process in processes:
            if process.is_running():
                process.kill()


@pytest.mark.heavy  # starts a process
def test_a_normal_stop_ends_the_reaper_and_touches_nothing(tmp_path):
    temp_dir = tmp_path / "ray_x"
    temp_dir.mkdir()
    child = subprocess.Popen(SLEEPER)  # a child of this "driver", recorded by the reaper
    try:
        reaper = run_reaper.start_reaper(str(temp_dir))
        deadline = time.time() + 60  # the reaper's first record: a fixed wait flaked with a busy machine
        while child.pid not in dict(run_reaper.read_record(temp_dir)) and time.time() < deadline:
            time.sleep(0.1)
        assert child.pid in dict(run_reaper.read_record(temp_dir))
        assert reaper.process.poll() is None  # it waits while the driver lives
        reaper.stop()
        assert reaper.process.returncode == 0
        assert child.poll() is None and temp_dir.exists()  # the driver's own shutdown does the rest
    finally:
        child.kill()
        child.wait()


@pytest.mark.heavy  # starts a process
def test_the_pipe_ending_without_the_stop_word_is_a_death_even_while_the_driver_looks_alive(ray_head, tmp_path):
    """A SIGKILLed driver's files close before it is a zombie: the reaper can see the pipe end while the
    driver's pid still reads as running. A CI run saw the reaper take that for a normal stop and leave the
    agent running. Here this process plays the driver and ends the pipe without the word. The reaper then
    kills every process this one started: the session's Ray cluster stops first (the next module that
    needs one starts it again)."""
    ray_head.stop()
    temp_dir = tmp_path / "ray_x"
    temp_dir.mkdir()
    child = subprocess.Popen(SLEEPER)  # the "agent", recorded by the reaper
    read_end, write_end = os.pipe()
    pid, start = identity()
    reaper = subprocess.Popen([sys.executable, "-m", "megarl.cluster.run_reaper", str(temp_dir), str(read_end),
                               str(pid), repr(start)], pass_fds=(read_end,), env={**os.environ, "PYTHONPATH": str(REPO)})
    os.close(read_end)
    try:
        deadline = time.monotonic() + 60
        while child.pid not in dict(run_reaper.read_record(temp_dir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.close(write_end)
        assert reaper.wait(timeout=30) == 0
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert not temp_dir.exists()
    finally:
        reaper.kill()
        child.kill()
        child.wait()

