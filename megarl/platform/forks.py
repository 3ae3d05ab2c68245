"""Forked children die with the process that forked them (Linux ``PR_SET_PDEATHSIG``).

A forked child inherits every descriptor of its parent, its Ray connections included. megatron's
checkpoint writer processes are forks of the trainer rank (``dist_checkpointing``'s
``FileSystemWriterAsync``): when a rank was killed while they ran, an orphaned writer kept the dead
rank's Ray sockets open, so Ray saw the actor alive until its keepalive timed out and the driver
hung 460 s (measured). ``kill_forks_with_parent()``, called once in a process, makes every later
``os.fork`` child (multiprocessing's ``fork`` context included; ``spawn`` and ``subprocess`` children
exec and are not forks) ask the kernel for SIGKILL when the thread that forked it ends: the writer
dies with the rank. megatron's writers are waited for by the thread that forks them, so that thread
outlives them.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_installed = False
_forking_pid = 0  # recorded just before each fork


def _remember_parent() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused: the child lives as before
    if os.getppid() != _forking_pid:  # the parent died before the request took effect
        os._exit(1)


def kill_forks_with_parent() -> bool:
    """From now on, forks of this process are killed when their forking thread ends; False off Linux."""
    global _installed
    if not sys.platform.startswith("linux"):
        return False
    if not _installed:
        os.register_at_fork(before=_remember_parent, after_in_child=_die_with_parent)
        _installed = True
    return True
