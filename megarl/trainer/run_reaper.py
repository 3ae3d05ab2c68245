"""What a local Ray cluster leaves when its driver dies without cleaning up: found and removed.

After a SIGKILL of the driver (the kernel's out-of-memory killer, ``kill -9``) Ray's GCS and raylet
die with it (they fate-share with the process that started them), and the trainer ranks and the
vLLM engines within 6 s (Ray ends a job's actors when their raylet or driver goes). What lingered
(measured: 62 s) were the raylet's two agents (dashboard, runtime-env): they notice the raylet's
death in 2 s, then wait 60 s for the dead GCS to take their last report. And the cluster's temp dir
(``/tmp/ray_*``) was never removed.

* The reaper: ``start_reaper`` runs ``python -m megarl.trainer.run_reaper`` beside a local cluster,
  in a session of its own (a Ctrl-C or a signal to the driver's process group does not reach it).
  It holds the read end of a pipe only the driver writes to: the pipe ends when the driver does
  (and the reaper checks the driver's pid and start time every second as well). Then it kills
  every process that carries the run's id (``MEGARL_RUN_ID`` in its environment, which everything
  the cluster starts inherits from the driver) and removes the temp dir. A normal shutdown closes
  the pipe after the cluster is gone, and the reaper finds nothing left.
* Stale temp dirs: each local cluster's temp dir holds ``megarl-run.json`` (the driver's pid and
  start time, the run's id). ``remove_stale_temp_dirs``, run before a new local cluster starts,
  removes the temp dirs (of this user) whose driver is provably gone (no process with that pid and
  start time), after killing whatever still carries their run's id: what is left when the reaper
  died too (``kill -9`` of every process of the run, a machine reset).
"""
from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

RUN_ID_VARIABLE = "MEGARL_RUN_ID"
MARKER = "megarl-run.json"
_START_TIME_TOLERANCE_S = 0.01


def new_run_id() -> str:
    return uuid.uuid4().hex


def write_marker(temp_dir: str, run_id: str) -> None:
    """Record in the temp dir which driver owns it (this process) and the run's id."""
    import psutil

    me = psutil.Process()
    Path(temp_dir, MARKER).write_text(json.dumps({"pid": me.pid, "create_time": me.create_time(), "run_id": run_id}))


def driver_alive(pid: int, create_time: float) -> bool:
    """True while a process runs under ``pid`` with that start time (a reused pid is another process)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return (abs(process.create_time() - create_time) < _START_TIME_TOLERANCE_S
                and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # not ours to judge


def processes_of_run(run_id: str) -> list:
    """Every process (of this user) whose environment carries ``MEGARL_RUN_ID=run_id``, this one excepted."""
    import psutil

    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(RUN_ID_VARIABLE) == run_id:
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def kill_run(run_id: str, wait_s: float = 10.0) -> int:
    """SIGKILL the run's processes and wait for them (at most ``wait_s``); return how many there were."""
    import psutil

    processes = processes_of_run(run_id)
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=wait_s)
    return len(processes)


def remove_stale_temp_dirs(parent: str = "/tmp") -> list[str]:
    """Remove the temp dirs under ``parent`` of local clusters (this user's) whose driver is gone; return them."""
    removed = []
    for marker in sorted(Path(parent).glob(f"ray_*/{MARKER}")):
        try:
            if marker.stat().st_uid != os.getuid():
                continue
            record = json.loads(marker.read_text())
            pid, create_time, run_id = int(record["pid"]), float(record["create_time"]), str(record["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours: leave it
        if driver_alive(pid, create_time):
            continue
        killed = kill_run(run_id)
        shutil.rmtree(marker.parent, ignore_errors=True)
        removed.append(str(marker.parent))
        logger.info("removed %s, the temp dir of a run whose driver (pid %d) is gone%s", marker.parent, pid,
                    f", and {killed} process(es) it left" if killed else "")
    return removed


class Reaper:
    """The driver's end of the reaper: ``stop()`` once the cluster is down."""

    def __init__(self, temp_dir: str, run_id: str):
        import psutil

        read_end, self._write_end = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != RUN_ID_VARIABLE}
        me = psutil.Process()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "megarl.trainer.run_reaper", temp_dir, run_id, str(read_end), str(me.pid),
                 repr(me.create_time())], pass_fds=(read_end,), start_new_session=True, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            os.close(read_end)

    def stop(self, wait_s: float = 10.0) -> None:
        if self._write_end is not None:
            os.close(self._write_end)
            self._write_end = None
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_reaper(temp_dir: str, run_id: str) -> Reaper:
    return Reaper(temp_dir, run_id)


def _wait_for_driver(fd: int, pid: int, create_time: float) -> None:
    """Return when the pipe ends or the driver is gone, whichever is first."""
    while True:
        readable, _, _ = select.select([fd], [], [], 1.0)
        if readable and not os.read(fd, 4096):
            return
        if not driver_alive(pid, create_time):
            return


def main(argv: list[str]) -> int:
    temp_dir, run_id, fd, pid, create_time = argv[0], argv[1], int(argv[2]), int(argv[3]), float(argv[4])
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _wait_for_driver(fd, pid, create_time)
    kill_run(run_id)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
