"""One trainer rank's profiler: the start and stop of torch.profiler traces or nsys capture ranges.

The controller brackets a profiled step's worker calls with ``profile_begin`` / ``profile_end``
(``RLTrainer.train_step``); each compute method of ``MegatronWorker`` runs inside ``stage(role, name)``.
What is recorded, where and on which ranks is ``megarl.settings.profiling`` (its docstring has the
layout). A rank that records nothing holds no ``RankProfiler`` at all (``rank_profiler`` returns None),
and a rank that does creates a ``torch.profiler.profile`` only for the steps it records.

A Ray actor runs its calls on a pool of threads (``max_concurrency``), so one step's calls may run on
different threads, and a kineto session must start and stop on one: the trace starts and stops on a
thread of the profiler's own and records every thread (``profile_all_threads``).
"""
from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch

from megarl import platform

logger = logging.getLogger(__name__)
TRACE_SUFFIX = ".pt.trace.json"  # TensorBoard's profile plugin lists files so named; Perfetto opens them too


def rank_profiler(settings, rank: int) -> "RankProfiler | None":
    """The profiler of trainer rank ``rank``; None when profiling is off or records nothing here."""
    if settings is None or not settings.on_rank(rank):
        return None
    return RankProfiler(settings, rank)


class RankProfiler:
    def __init__(self, settings, rank: int):
        self.settings, self.rank = settings, rank
        self.step: int | None = None  # the profiled step now running
        self._trace = None  # the running torch profiler
        self._capturing = False  # nsys: a CUDA profiler capture range is open
        self._owner = ThreadPoolExecutor(1, thread_name_prefix="megarl-profiler")  # starts and stops the traces

    # ------------------------------------------------------------------ the controller's brackets
    def begin(self, step: int) -> None:
        if not self.settings.profiles(step):
            return
        self.step = step
        if not self.settings.discrete and not self._running():
            self._start(self.settings.contents(self.rank))

    def end(self, step: int) -> None:
        if self.step != step:
            return
        self.step = None
        first, last = self.settings.window(step)
        if not self.settings.discrete and step == last:
            name = f"step_{step}" if first == last else f"steps_{first}-{last}"
            self._stop(Path(self.settings.save_dir) / name / f"rank_{self.rank}")

    # ------------------------------------------------------------------ the worker's stages
    @contextlib.contextmanager
    def stage(self, role: str, name: str) -> Iterator[None]:
        """``role``'s ``name`` stage (log_prob, values, update): labelled in a step's trace, or its own
        trace (discrete) when ``role`` records on this rank."""
        if self.step is None:
            yield
            return
        label = f"megarl/{role}/{name}"
        if not self.settings.discrete:
            with self._label(label):
                yield
            return
        if not self.settings.role_on(role, self.rank):
            yield
            return
        self._start(self.settings.contents(self.rank, role))
        try:
            with self._label(label):
                yield
        finally:
            self._stop(Path(self.settings.save_dir) / f"step_{self.step}" / f"{role}_{name}" / f"rank_{self.rank}")

    # ------------------------------------------------------------------ the tools
    def _running(self) -> bool:
        return self._trace is not None or self._capturing

    def _label(self, label: str):
        if self.settings.tool == "nsys":
            return platform.nvtx_range(label)
        return torch.profiler.record_function(label)

    def _start(self, contents: frozenset) -> None:
        if self.settings.tool == "nsys":
            platform.cuda_profiler(start=True)  # nsys records between start and stop (capture-range=cudaProfilerApi)
            self._capturing = True
            return
        from torch._C._profiler import _ExperimentalConfig

        def start():
            trace = torch.profiler.profile(activities=activities(contents), record_shapes="shapes" in contents,
                                           profile_memory="memory" in contents, with_stack="stack" in contents,
                                           experimental_config=_ExperimentalConfig(profile_all_threads=True))
            trace.start()
            return trace

        self._trace = self._owner.submit(start).result()

    def _stop(self, stem: Path) -> None:
        if self._capturing:
            platform.cuda_profiler(start=False)
            self._capturing = False
        if self._trace is None:
            return
        trace, self._trace = self._trace, None
        stem.parent.mkdir(parents=True, exist_ok=True)
        path = stem.with_name(stem.name + TRACE_SUFFIX)

        def stop():
            trace.stop()
            trace.export_chrome_trace(str(path))

        self._owner.submit(stop).result()
        logger.info("profiler trace: %s", path)


def activities(contents: frozenset) -> list:
    """CPU always (the stage labels and the operators are CPU events); CUDA when asked for and present."""
    chosen = [torch.profiler.ProfilerActivity.CPU]
    if "cuda" in contents and platform.has_cuda():
        chosen.append(torch.profiler.ProfilerActivity.CUDA)
    return chosen
