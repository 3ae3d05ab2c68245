"""Start sync participants as real processes (spawn) and make sure none outlives its deadline."""
from __future__ import annotations

import multiprocessing as mp
import time

from tests.ports import free_port  # noqa: F401  (the tests import it from here)


def run_processes(target, args_per_rank: list[tuple], deadline_s: float) -> tuple[list[int | None], float]:
    """Run ``target(*args)`` per rank in its own process; return exit codes (None = hung, then killed) and seconds."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args, daemon=True) for args in args_per_rank]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(max(0.1, deadline_s - (time.monotonic() - start)))
    seconds = time.monotonic() - start
    codes = []
    for proc in procs:
        if proc.is_alive():  # a hang: stop this process (by its own handle) and report None
            proc.kill()
            proc.join(5)
            codes.append(None)
        else:
            codes.append(proc.exitcode)
    return codes, seconds
