"""Python's cyclic garbage collector in the processes megarl starts: collect less often.

CPython 3.11 runs a collection every 700 net new container objects (``gc.get_threshold()`` is
``(700, 10, 10)``), and a full one after every 10 x 10 of those. Importing torch, transformers,
megatron-core and vLLM creates millions of objects that all live as long as the process, so a
start-up spends a quarter of its CPU time walking that heap again and again: measured on 2 cores,
importing a trainer rank's modules takes 4.4-4.9 CPU-seconds at the default, 3.6 at a first threshold
of 10,000 and 3.3 with the collector off; a vLLM replica's imports 8.2-8.7 and 6.4-7.5 without the collector.
A larger first threshold keeps the collector on (reference cycles are still freed, a little later)
and takes most of that away; it stays for the process's lifetime, as torchtitan keeps its own
collection schedule for the training loop and vLLM freezes its engine's start-up heap.

``tune_gc()`` is called first thing where a megarl process starts: the command-line entry points, and
every Ray worker of a run, through Ray's ``worker_process_setup_hook`` (``RAY_WORKER_SETUP_HOOK``,
which ``init_ray`` puts in the job's runtime environment), so it runs before an actor's class and
its imports load. ``MEGARL_GC_THRESHOLD`` overrides the first threshold (``0`` keeps Python's).
"""
from __future__ import annotations

import gc
import os

FIRST_THRESHOLD = 10_000  # Python's default is 700
GC_THRESHOLD_ENV = "MEGARL_GC_THRESHOLD"
RAY_WORKER_SETUP_HOOK = f"{__name__}.tune_gc"  # a module path: Ray imports it in each worker it starts


def tune_gc() -> None:
    """Raise the collector's first threshold to ``FIRST_THRESHOLD`` (``$MEGARL_GC_THRESHOLD`` when set;
    ``0`` leaves Python's). The older generations' thresholds stay Python's."""
    raw = os.environ.get(GC_THRESHOLD_ENV, "").strip()
    try:
        first = int(raw) if raw else FIRST_THRESHOLD
    except ValueError:
        raise ValueError(f"MEGARL_GC_THRESHOLD={raw!r} is not an integer: give the collector's first threshold "
                         f"(Python's default 700, megarl's {FIRST_THRESHOLD}), or 0 to keep Python's") from None
    if first < 0:
        raise ValueError(f"MEGARL_GC_THRESHOLD={raw!r} is negative: give the collector's first threshold, or 0")
    if first:
        _, second, third = gc.get_threshold()
        gc.set_threshold(first, second, third)
