"""What a local Ray cluster leaves when its driver dies without cleaning up: found and removed.

After a SIGKILL of the driver (the kernel's out-of-memory killer, ``kill -9``) Ray's GCS and raylet
die with it (they fate-share with the process that started them), and the trainer ranks and the
vLLM engines within 6 s (Ray ends a job's actors when their raylet goes). What lingered (measured:
62 s) were the raylet's two agents (dashboard, runtime-env): they notice the raylet's death in 2 s,
then wait 60 s for the dead GCS to take their last report. And the cluster's temp dir
(``/tmp/ray_*``) was never removed.

* The reaper: ``start_reaper`` runs ``python -m megarl.cluster.run_reaper`` beside a local cluster,
  in a session of its own (a Ctrl-C or a signal to the driver's process group does not reach it).
  Every second it records the driver's descendants (pid and start time: Ray renames its processes
  and overwrites their environment, and orphans leave the tree, so only a record made while the
  tree is whole finds them all) into ``<temp dir>/megarl-processes.json``. It holds the read end
  of a pipe only the driver writes to. A normal shutdown writes ``STOP`` into the pipe once the
  cluster is gone: the reaper then ends and touches nothing. The pipe ending without that word
  means the driver died (the kernel closes a dying process's files before it is a zombie, so the
  driver's pid can still look alive then: only the word tells a stop from a death); so does the
  driver's pid and start time vanishing (checked each second, in case a forked child holds the
  pipe). Then it kills every recorded process still running, with its descendants, and removes the
  temp dir.
* Stale temp dirs: each local cluster's temp dir holds ``megarl-run.json`` (the driver's pid and
  start time). ``remove_stale_temp_dirs``, run before a new local cluster starts, removes the temp
  dirs (of this user) whose driver is provably gone (no process with that pid and start time),
  after killing the processes their last record names: what is left when the reaper died too
  (``kill -9`` of every process of the run).
* A record is up to a second old, so processes started since (a vLLM engine core a worker was
  starting when the driver died) are not in it. They still hold files in the temp dir (Ray's logs,
  the workers' ``TMPDIR``, vLLM's unix sockets) and go on creating them while they die, which once
  left a half-removed temp dir behind (a CI run). So the removal also kills every process of this
  user holding something in the dir, and retries until the dir is gone.
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
import time
from pathlib import Path

from megarl.platform.processes import ended, identity, running, start_time

logger = logging.getLogger(__name__)

MARKER = "megarl-run.json"
RECORD = "megarl-processes.json"
STOP = b"stop"  # the driver's word for a normal shutdown, written into the reaper's pipe


def write_marker(temp_dir: str) -> None:
    """Record in the temp dir which driver owns it: this process."""
    pid, start = identity()
    Path(temp_dir, MARKER).write_text(json.dumps({"pid": pid, "start": start}))


def kill_recorded(recorded: list[tuple[int, float]], wait_s: float = 10.0) -> int:
    """SIGKILL the recorded processes still running and their descendants; return how many there were."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for pid, start in recorded:
        process = running(pid, start)
        if process is None:
            continue
        found[pid] = process
        try:
            found.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.Error:
            pass
    for process in found.values():
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(found.values()), timeout=wait_s)
    return len(found)


def read_record(temp_dir: str | Path) -> list[tuple[int, float]]:
    try:
        return [(int(pid), float(start)) for pid, start in json.loads(Path(temp_dir, RECORD).read_text())]
    except (OSError, ValueError, TypeError):
        return []


def remove_stale_temp_dirs(parent: str = "/tmp") -> list[str]:
    """Remove the temp dirs under ``parent`` of local clusters (this user's) whose driver is gone; return them."""
    removed = []
    for marker in sorted(Path(parent).glob(f"ray_*/{MARKER}")):
        try:
            if marker.stat().st_uid != os.getuid():
                continue
            record = json.loads(marker.read_text())
            pid, start = int(record["pid"]), float(record["start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, not ours, or an older megarl's (start time on the wall clock): leave it
        if running(pid, start) is not None:
            continue
        killed = remove_temp_dir(marker.parent, read_record(marker.parent))
        removed.append(str(marker.parent))
        logger.info("removed %s, the temp dir of a run whose driver (pid %d) is gone%s", marker.parent, pid,
                    f", and {killed} process(es) it left" if killed else "")
    return removed


def holders(temp_dir: str | Path) -> list[tuple[int, float]]:
    """(pid, start) of this user's processes (other than this one) that hold something inside ``temp_dir``: their
    working dir, an open file, a unix socket, or an argument naming it."""
    import psutil

    inside = str(Path(temp_dir)) + os.sep
    found = []
    for process in psutil.process_iter(["uids"]):
        try:
            if process.pid == os.getpid() or process.info["uids"] is None or process.info["uids"].real != os.getuid():
                continue
            paths = [process.cwd(), *process.cmdline(), *(f.path for f in process.open_files()),
                     *(c.laddr for c in process.net_connections("unix") if isinstance(c.laddr, str))]
            if any(inside in path + os.sep for path in paths):
                found.append((process.pid, start_time(process.pid)))
        except psutil.Error:
            continue
    return found


def remove_temp_dir(temp_dir: str | Path, recorded: list[tuple[int, float]], attempts: int = 10) -> int:
    """Kill the recorded processes and every process holding something in ``temp_dir``, then remove it, again
    while something recreates files there; return how many processes were killed."""
    killed = kill_recorded(recorded)
    for _ in range(attempts):
        killed += kill_recorded(holders(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
        if not os.path.exists(temp_dir):
            return killed
        time.sleep(0.5)
    try:
        left = ", ".join(sorted(str(p.relative_to(temp_dir)) for p in Path(temp_dir).rglob("*"))[:10])
    except OSError as exc:
        left = str(exc)
    logger.warning("could not remove %s (still in it: %s)", temp_dir, left or "nothing")
    return killed


class Reaper:
    """The driver's end of the reaper (a child process): ``stop()`` once the cluster is down."""

    def __init__(self, temp_dir: str):
        read_end, self._write_end = os.pipe()
        pid, start = identity()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "megarl.cluster.run_reaper", temp_dir, str(read_end), str(pid), repr(start)],
                pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            os.close(read_end)

    def stop(self, wait_s: float = 10.0) -> None:
        if self._write_end is not None:
            try:
                os.write(self._write_end, STOP)
            finally:
                os.close(self._write_end)
                self._write_end = None
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_reaper(temp_dir: str) -> Reaper:
    return Reaper(temp_dir)


def _watch(temp_dir: str, fd: int, driver) -> tuple[list[tuple[int, float]], bool]:
    """Record the driver's descendants every second until the driver says stop, or dies; the record, and
    whether it was a stop."""
    import psutil

    recorded: dict[int, float] = {}
    while True:
        now = {}
        try:
            children = [p.pid for p in driver.children(recursive=True) if p.pid != os.getpid()]
        except psutil.Error:
            children = []
        for pid in children:
            try:
                now[pid] = start_time(pid)
            except psutil.Error:
                pass  # ended since the listing
        if any(recorded.get(pid) != start for pid, start in now.items()):
            recorded.update(now)
            recorded = {pid: start for pid, start in recorded.items() if running(pid, start) is not None}
            staging = Path(temp_dir, RECORD + ".tmp")
            try:
                staging.write_text(json.dumps(sorted(recorded.items())))
                os.replace(staging, Path(temp_dir, RECORD))
            except OSError:
                pass  # the temp dir is being removed
        readable, _, _ = select.select([fd], [], [], 1.0)
        if readable:  # the stop word, or the end of the pipe: a driver that died
            return sorted(recorded.items()), os.read(fd, len(STOP)) == STOP
        if ended(driver):
            return sorted(recorded.items()), False


def main(argv: list[str]) -> int:
    temp_dir, fd, pid, start = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    driver = running(pid, start)
    if driver is None:  # gone before this process looked
        recorded = read_record(temp_dir)
    else:
        recorded, stopped = _watch(temp_dir, fd, driver)
        if stopped:
            return 0  # a normal stop: the driver shut its cluster down itself
    remove_temp_dir(temp_dir, recorded)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
