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

from megarl.trainer import run_reaper

REPO = Path(__file__).resolve().parents[2]


def run_process(run_id: str) -> subprocess.Popen:
    """A process of the run: it carries the run's id, as everything a local cluster starts does."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            env={**os.environ, run_reaper.RUN_ID_VARIABLE: run_id})


def marker(directory: Path, pid: int, create_time: float, run_id: str) -> Path:
    directory.mkdir()
    (directory / run_reaper.MARKER).write_text(json.dumps({"pid": pid, "create_time": create_time, "run_id": run_id}))
    return directory


def test_the_next_run_removes_only_dead_runs_temp_dirs(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_identity = (gone.pid, psutil.Process(gone.pid).create_time())
    gone.wait()
    me = psutil.Process()
    dead_id, live_id = run_reaper.new_run_id(), run_reaper.new_run_id()
    leftover = run_process(dead_id)
    untouched = run_process(live_id)
    try:
        dead = marker(tmp_path / "ray_dead", *gone_identity, dead_id)
        reused = marker(tmp_path / "ray_reused", me.pid, me.create_time() - 100, run_reaper.new_run_id())  # pid reused
        live = marker(tmp_path / "ray_live", me.pid, me.create_time(), live_id)
        foreign = tmp_path / "ray_foreign"
        foreign.mkdir()  # no marker: not a megarl cluster's
        removed = run_reaper.remove_stale_temp_dirs(str(tmp_path))
        assert sorted(removed) == sorted([str(dead), str(reused)])
        assert not dead.exists() and not reused.exists() and live.exists() and foreign.exists()
        leftover.wait(timeout=10)  # the dead run's leftover went with its dir (psutil reaped it: no exit code here)
        assert untouched.poll() is None  # a live run's process is not touched
    finally:
        for process in (leftover, untouched):
            process.kill()
            process.wait()


DRIVER = textwrap.dedent('''
    import os, subprocess, sys, tempfile, time
    from megarl.trainer import run_reaper

    temp_dir = tempfile.mkdtemp(prefix="ray_", dir=sys.argv[1])
    run_id = run_reaper.new_run_id()
    run_reaper.write_marker(temp_dir, run_id)
    os.environ[run_reaper.RUN_ID_VARIABLE] = run_id
    reaper = run_reaper.start_reaper(temp_dir, run_id)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print(temp_dir, reaper.process.pid, worker.pid, flush=True)
    time.sleep(300)
''')


def test_the_reaper_cleans_up_after_a_killed_driver(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    temp_dir, reaper_pid, worker_pid = driver.stdout.readline().split()
    processes = [psutil.Process(int(reaper_pid)), psutil.Process(int(worker_pid))]
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


def test_a_normal_stop_ends_the_reaper_and_touches_nothing_alive(tmp_path):
    temp_dir = tmp_path / "ray_x"
    temp_dir.mkdir()
    run_id = run_reaper.new_run_id()
    other = run_process(run_reaper.new_run_id())
    try:
        reaper = run_reaper.start_reaper(str(temp_dir), run_id)
        time.sleep(0.5)
        assert reaper.process.poll() is None  # it waits while the driver lives
        reaper.stop()
        assert reaper.process.returncode == 0
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
