"""The two-rank model tests' torchrun plumbing: run a worker script on 2 gloo ranks, read its records.

A worker (``_dist_worker.py``, ``_vision_worker.py``, ``_grouped_worker.py``) runs its scenarios on both ranks
and ``write_records`` gathers one JSON record per (scenario, rank) into ``<directory>/<results>``; a scenario
that failed on a rank carries ``error`` (its traceback) instead of its figures.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path

from megarl.platform import destroy_model_parallel
from tests.ports import run_ranks, torchrun

REPO = Path(__file__).resolve().parents[2]


def run_two_ranks(worker: Path, directory: Path, results: str, timeout: int) -> dict:
    """Run ``worker directory`` under torchrun on 2 ranks; return its records by (scenario, rank)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [*torchrun(2), str(worker),
               str(directory)]
    done = run_ranks(command, env=env, timeout=timeout)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    records = json.loads((directory / results).read_text())
    return {(r["scenario"], r["rank"]): r for r in records}


def rank_records(results: dict, scenario: str) -> list[dict]:
    """Both ranks' records of a scenario; fails with a rank's traceback where it raised."""
    found = [results[(scenario, rank)] for rank in (0, 1)]
    for record in found:
        assert "error" not in record, f"{scenario} rank {record['rank']}:\n{record['error']}"
    return found


@contextlib.contextmanager
def recorded(record: dict):
    """In a worker, around one scenario: an exception goes into ``record["error"]`` (the other scenarios still
    run), the time into ``record["seconds"]``; megatron's parallel state and its groups are torn down after it."""
    started = time.perf_counter()
    try:
        yield record
    except Exception:
        record["error"] = traceback.format_exc()
    record["seconds"] = round(time.perf_counter() - started, 2)
    destroy_model_parallel()


def write_records(records: list[dict], path: Path) -> None:
    """In a worker: gather every rank's records to rank 0, which writes them to ``path``; then end the group."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        path.write_text(json.dumps([r for rank in gathered for r in rank], indent=1))
    dist.destroy_process_group()
