"""Start the engine worker (``_engine_worker.py``) in one process or under torchrun, and read its results."""
import os
import sys
from pathlib import Path

import torch

from tests.ports import run_ranks, torchrun

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_engine_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def run_worker(work: Path, mode: str, processes: int, timeout: int, worker: Path = WORKER) -> dict:
    """Run ``<worker> <mode> <work>`` (default ``_engine_worker.py``) and return what it saved in ``<work>/<mode>.pt``."""
    if processes == 1:
        command = [sys.executable, str(worker), mode, str(work)]
    else:
        command = [*torchrun(processes), str(worker), mode, str(work)]
    done = run_ranks(command, env=ENV, timeout=timeout)
    assert done.returncode == 0, f"{mode} worker failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    return torch.load(work / f"{mode}.pt", weights_only=False)
