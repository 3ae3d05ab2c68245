"""Run untrusted Python code in a sandbox: bubblewrap namespaces, an unprivileged uid, rlimits.

One call = one fresh process tree, started as::

    prlimit (AS, CPU, NPROC, FSIZE, NOFILE)  ->  bwrap (new mount, PID, network, IPC, UTS namespaces)
        ->  setpriv (uid/gid 60000+k, no capabilities, no_new_privs)  ->  python -I -c CODE

What the code sees and can do:

- **Files**: a new root holding only ``/usr`` (read-only), the Python installation (read-only, at
  ``/opt/python``), a fresh ``/proc`` of its own PID namespace, a minimal ``/dev``, and two
  size-limited tmpfs: the scratch directory ``/work`` (its working directory) and ``/tmp``. No
  ``/etc``, no home, no repository, no host ``/tmp``: there is nothing else to read or write, and
  the scratch is gone when the call ends.
- **Network**: a new network namespace whose only interface is its own loopback (up: bubblewrap
  brings it up), so the code can talk to itself on 127.0.0.1 but no socket reaches anything outside
  the namespace, on this machine or elsewhere (abstract Unix sockets are per namespace too).
- **Processes**: it runs as an unprivileged uid of its own (``RLIMIT_NPROC`` bounds a fork bomb),
  in its own PID namespace (it cannot see or signal anything outside); when the call ends or times
  out the namespace's init is killed and the kernel kills every process in it, so nothing outlives
  the timeout.
- **Resources**: the memory of the whole call (``memory_mb``, all its processes together: a
  memory cgroup of its own, ``cgroup.py``, where the host allows one; elsewhere at most
  ``FALLBACK_PROCESSES`` processes of ``memory_mb / FALLBACK_PROCESSES`` address space each), CPU
  seconds, the size of any file it writes and the tmpfs sizes are bounded; stdout and stderr are cut
  at ``max_output_bytes``.

It needs Linux with bubblewrap (``bwrap``, Debian package ``bubblewrap``) and ``setpriv``
(util-linux), run as root (as the trainer is in containers): elsewhere ``check_available`` raises
naming what is missing, and the tool refuses to start. Not covered: kernel exploits (a seccomp
filter or a VM would narrow that surface), CPU time shared with the host (the CPU limit is per
call).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.agent.tools.cgroup import CallCgroup, memory_cgroups

_UIDS = itertools.count()
FALLBACK_PROCESSES = 4  # without a memory cgroup: processes per call, each with memory_mb / 4 of address space


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10
    memory_mb: int = 512  # the whole call: all its processes together
    max_processes: int = 32  # FALLBACK_PROCESSES where the host gives no memory cgroup
    max_file_mb: int = 16
    scratch_mb: int = 64  # tmpfs /work and /tmp, each
    max_output_bytes: int = 65536
    uid_base: int = 60000  # each call runs as uid_base + k (k cycles over 1000), gid the same


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the timeout
    timed_out: bool
    output_truncated: bool
    seconds: float
    memory_exceeded: bool = False  # the OOM killer ended a process at the call's memory limit


class SandboxUnavailable(RuntimeError):
    pass


def check_available() -> None:
    """Raise ``SandboxUnavailable`` naming what this machine lacks to run the sandbox."""
    problems = []
    if not sys.platform.startswith("linux"):
        problems.append(f"it needs Linux namespaces (this is {sys.platform})")
    if shutil.which("bwrap") is None:
        problems.append("bubblewrap is not installed (apt-get install bubblewrap)")
    for tool in ("setpriv", "prlimit"):
        if shutil.which(tool) is None:
            problems.append(f"{tool} is not installed (apt-get install util-linux)")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        problems.append("it must run as root, to switch the code to an unprivileged uid of its own")
    if problems:
        raise SandboxUnavailable("the Python code sandbox cannot start: " + "; ".join(problems))


def python_home() -> Path:
    """The Python installation the sandbox runs (the interpreter of this process, without the venv)."""
    return Path(sys.base_prefix)


def command(code: str, limits: SandboxLimits, uid: int, in_cgroup: bool = True) -> list[str]:
    """The sandbox's command line; ``in_cgroup=False``: no cgroup bounds the call's memory as a whole,
    so it gets ``FALLBACK_PROCESSES`` processes of ``memory_mb / FALLBACK_PROCESSES`` each."""
    home = python_home()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    mb = 1 << 20
    processes = limits.max_processes if in_cgroup else min(limits.max_processes, FALLBACK_PROCESSES)
    memory = limits.memory_mb * mb if in_cgroup else limits.memory_mb * mb // processes
    rlimits = [f"--as={memory}", f"--cpu={limits.cpu_s}", f"--nproc={processes}",
               f"--fsize={limits.max_file_mb * mb}", "--nofile=256", "--core=0"]
    return [
        "prlimit", *rlimits, "--", "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--ro-bind", str(home), "/opt/python",
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", str(limits.scratch_mb * mb), "--tmpfs", "/tmp",
        "--perms", "0777", "--size", str(limits.scratch_mb * mb), "--tmpfs", "/work", "--chdir", "/work",
        "--clearenv", "--setenv", "PATH", "/opt/python/bin:/usr/bin", "--setenv", "HOME", "/work",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--", "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", f"/opt/python/bin/{version}", "-I", "-c", code,
    ]


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in a fresh sandbox; never raises for anything the code does."""
    check_available()
    uid = limits.uid_base + next(_UIDS) % 1000
    cgroups = memory_cgroups()
    call = CallCgroup(cgroups, limits.memory_mb << 20) if cgroups is not None else None
    argv = command(code, limits, uid, in_cgroup=call is not None)
    try:
        return await _run(call.join_command(argv) if call is not None else argv, limits, call)
    finally:
        if call is not None:
            call.close()


async def _run(argv: list[str], limits: SandboxLimits, call: CallCgroup | None) -> SandboxResult:
    start = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    truncated = False

    async def read(stream) -> bytes:
        nonlocal truncated
        chunks, size = [], 0
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return b"".join(chunks)
            if size < limits.max_output_bytes:
                chunks.append(chunk[: limits.max_output_bytes - size])
            if size + len(chunk) > limits.max_output_bytes:
                truncated = True
            size += len(chunk)

    reading = asyncio.gather(read(process.stdout), read(process.stderr), process.wait())
    timed_out = False
    try:
        out, err, _ = await asyncio.wait_for(reading, limits.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
        _kill(process.pid)
        out, err, _ = await asyncio.wait_for(asyncio.gather(read(process.stdout), read(process.stderr),
                                                            process.wait()), 30)
    except BaseException:  # cancelled (e.g. the tool call's own timeout): take the sandbox down with it
        _kill(process.pid)
        raise
    return SandboxResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         None if timed_out else process.returncode, timed_out, truncated,
                         time.perf_counter() - start, call is not None and call.oom_killed())


def _kill(pid: int) -> None:
    """SIGKILL bwrap's process group; its PID namespace dies with it (``--die-with-parent``)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
