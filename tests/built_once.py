"""Session fixtures that pytest-xdist workers build once between them.

A session-scoped fixture runs once per xdist worker, so on 2 workers the tiny checkpoints, their HF
references and the conversion CLI's outputs were each built twice whenever modules that use them
landed on both workers (a tensor-parallel conversion costs about a minute on 2 cores). ``built_once``
builds into a directory shared by the session's workers, under a file lock: the first worker to ask
builds while the others wait, then every worker reads the same result. What is built must be treated
as read-only, as it already was within one worker.
"""
from __future__ import annotations

import fcntl
import os
import pickle
import shutil
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
DONE = ".built"  # written last: a worker that died while building leaves none, and the next one rebuilds


def session_dir(tmp_path_factory) -> Path:
    """The directory the session's workers share: the parent of each worker's own base temp dir under xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """``build(directory)``'s result, built into ``<session dir>/<name>`` by the first worker that asks."""
    directory = session_dir(tmp_path_factory) / name
    with open(f"{directory}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the worker dies
        done = directory / DONE
        if done.exists():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        result = build(directory)
        done.write_bytes(pickle.dumps(result))
        return result
