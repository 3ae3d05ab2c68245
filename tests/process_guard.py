"""The split of the suite into light and heavy tests, and the guard that keeps it honest.

``make test`` (scripts/run_tests.sh) runs the tests that start no processes on 2 pytest-xdist workers,
then the *heavy* ones (Ray clusters, vLLM engines, torchrun, subprocesses, Slurm), whole modules per
worker: a module's shared cluster or engine stays with it, and a heavy test may wait on timeouts and
signals, so it must not assume the machine to itself. A test is heavy when it carries the
``heavy`` marker or one that implies it (``HEAVY_MARKERS``). A test that is not heavy and starts a
process anyway would land among the parallel ones and slow or flake there, so it fails instead, naming
the marker to add: while a light test sets up, runs and tears down, every way Python starts a process
(fork, posix_spawn, the fork-exec under subprocess and multiprocessing's spawn) raises, but for the
C++ compiler torch.compile runs.
"""
import _posixsubprocess
import contextlib
import os
import subprocess
import sys

import pytest

HEAVY_MARKERS = ("heavy", "distributed", "ray", "vllm", "slurm")
_INDUCTOR = os.path.join("torch", "_inductor", "")

# (module, attribute): every process start in CPython goes through one of these
# (subprocess keeps its own reference to fork_exec; os.system is left alone: a test pickles a reference
# to it, which must stay the real one)
_STARTERS = [(module, name) for module, name in [(os, "fork"), (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"),
                                                 (_posixsubprocess, "fork_exec"), (subprocess, "_fork_exec")]
             if getattr(module, name, None) is not None]


class LightTestStartedAProcess(RuntimeError):
    """A test without the heavy marker started a process."""


def _torch_compiling() -> bool:
    """Whether torch.compile's inductor starts the process: the C++ compiler it runs for a kernel
    (once per kernel, then cached) is part of running model code in one process, not a test's process."""
    frame = sys._getframe(2)
    while frame is not None:
        if _INDUCTOR in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def is_heavy(item) -> bool:
    return any(item.get_closest_marker(name) for name in HEAVY_MARKERS)


@contextlib.contextmanager
def no_process_starts(nodeid: str):
    """Make every process start raise, naming the test and the fix, until the block ends."""
    def refusing(original):
        def start(*args, **kwargs):
            if _torch_compiling():
                return original(*args, **kwargs)
            raise LightTestStartedAProcess(
                f"{nodeid} started a process but is not marked heavy, so it runs among the tests that "
                f"make test runs in parallel; mark it (or its module: pytestmark = pytest.mark.heavy, or "
                f"one of {', '.join(HEAVY_MARKERS[1:])}) so that it runs in the heavy phase")
        return start

    saved = [(module, name, getattr(module, name)) for module, name in _STARTERS]
    for module, name, original in saved:
        setattr(module, name, refusing(original))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Give every test that carries a marker implying ``heavy`` the marker itself, before ``-m``
    selects, so that ``-m heavy`` and ``-m "not heavy"`` split the suite."""
    for item in items:
        if is_heavy(item) and not item.get_closest_marker("heavy"):
            item.add_marker(pytest.mark.heavy)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a light test (its fixtures' set-up and tear-down included) with process starts refused."""
    with (contextlib.nullcontext() if is_heavy(item) else no_process_starts(item.nodeid)):
        yield
