"""A fork dies with the process that forked it (megatron's checkpoint writers with their rank)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

# A rank stand-in: it forks a writer (multiprocessing's fork context, as megatron's writer does) that
# would sleep for minutes, prints the writer's pid, and waits to be killed.
PARENT = textwrap.dedent('''
    import multiprocessing as mp, sys, time
    from megarl.platform.forks import kill_forks_with_parent

    if __name__ == "__main__":
        if sys.argv[1] == "guarded":
            assert kill_forks_with_parent()
        writer = mp.get_context("fork").Process(target=time.sleep, args=(300,))
        writer.start()
        print(writer.pid, flush=True)
        time.sleep(300)
''')


def orphan_after_parent_killed(mode: str) -> psutil.Process:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    writer = psutil.Process(int(parent.stdout.readline()))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    return writer


@pytest.mark.heavy  # starts a process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_fork_dies_with_its_parent():
    writer = orphan_after_parent_killed("guarded")
    _, alive = psutil.wait_procs([writer], timeout=10)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, "the forked writer outlived the process that forked it"


@pytest.mark.heavy  # starts a process
def test_without_the_guard_the_orphan_lives_on():
    """The failure the guard prevents, shown with the same stand-in."""
    writer = orphan_after_parent_killed("plain")
    try:
        _, alive = psutil.wait_procs([writer], timeout=2)
        assert alive and alive[0].status() != psutil.STATUS_ZOMBIE
    finally:
        writer.kill()
