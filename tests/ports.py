"""Ports for the processes a test starts, the torchrun command that uses one, and ``run_ranks``, which runs it.

A port picked by binding port 0 and closing the socket is an ephemeral port: until the test's
process binds it, any other process on the machine may be given it for an outgoing connection or
its own port-0 bind (a CI run lost a weight-sync store to "address already in use" that way, with
two pytest-xdist workers starting processes side by side). ``free_port`` therefore picks below
the kernel's ephemeral range and above Ray's worker ports (10002-19999), in a block of its own
for each xdist worker, and checks that nothing listens there yet.

``torchrun(n)`` starts n local ranks with a static rendezvous on such a port (torchrun's
``--standalone`` takes a port-0 port the same way, and its dynamic rendezvous has keep-alive
heartbeats that a loaded machine can miss). ``run_ranks`` starts its launch with ``tests/rank_site`` on
``PYTHONPATH``: its ``sitecustomize`` sets the garbage collector as megarl's own processes set it.
"""
from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

RANK_SITE = Path(__file__).resolve().parent / "rank_site"  # sitecustomize.py for the processes of a launch
FIRST, BLOCK = 20000, 2000  # blocks 20000-21999 (no xdist), 22000-23999 (gw0), 24000-25999 (gw1), ...


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...; absent without xdist
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    blocks = max(1, (_ephemeral_start() - FIRST) // BLOCK)  # more workers than blocks share them
    start = FIRST + (index % blocks) * BLOCK
    return range(start, start + BLOCK)


_candidates = None


def free_port() -> int:
    """A port on 127.0.0.1 that nothing uses now, out of the kernel's ephemeral range, this xdist worker's own."""
    global _candidates
    block = _block()
    if _candidates is None:  # a random start: two test sessions side by side rarely walk the same ports
        first = random.randrange(len(block))
        _candidates = itertools.cycle([*block[first:], *block[:first]])
    for _ in range(len(block)):
        port = next(_candidates)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1}: is something holding them all?")


def torchrun(nproc: int) -> list[str]:
    """The command prefix that starts ``nproc`` local ranks under torchrun (static rendezvous, a ``free_port``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def run_ranks(command: list[str], *, env: dict | None = None, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=...)`` for a launch that starts
    processes of its own, such as torchrun and its ranks.

    On timeout every process of the launch (torchrun starts each rank in a session of its own, so only
    its process tree finds them) gets SIGABRT first, which Python's faulthandler, switched on here,
    answers by writing that process's stacks to stderr; SIGKILL follows for any left. The error carries
    those stacks, so a hang says where it hung, and no rank outlives the test to slow the ones after it
    (``subprocess.run`` kills only torchrun itself).
    """
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RANK_SITE), env.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = _tree(process.pid)
        _signal(tree, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            _signal(tree, signal.SIGKILL)
            stdout, stderr = process.communicate()
        raise AssertionError(f"{' '.join(command[:12])} ... did not end within {timeout:.0f} s; the stacks of its "
                             f"processes when stopped (stderr):\n{stderr[-12000:]}\nstdout:\n{stdout[-3000:]}") from None
    finally:
        _signal(_tree(process.pid), signal.SIGKILL)  # whatever outlived it (a timeout, an interrupted test)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _signal(processes: list, sig: int) -> None:
    import psutil

    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.Error:
            pass
        if sig == signal.SIGKILL:
            try:
                process.wait(5)
            except psutil.Error:
                pass
