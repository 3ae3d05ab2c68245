"""A trainer rank's profiler in this process (megarl.trainer.profiling): which steps, ranks and stages make
a trace, where it goes, and that it is a Chrome trace holding the stage labels and the operators. The
real run (a GRPO run's step 2 on the worker ranks) is in test_e2e.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megarl.settings.profiling import ProfilerSettings, RoleProfile
from megarl.trainer.profiling import rank_profiler


def settings(tmp_path: Path, steps=(2,), discrete=False, continuous=False, **roles) -> ProfilerSettings:
    roles = roles or {"actor": RoleProfile((0,))}
    return ProfilerSettings("torch", tuple(steps), str(tmp_path), roles, discrete=discrete, continuous=continuous)


def work() -> None:
    a = torch.randn(16, 16)
    (a @ a).sum()


def run_step(profiler, step: int, stages=(("actor", "log_prob"), ("critic", "values"), ("actor", "update"))) -> None:
    profiler.begin(step)
    for role, name in stages:
        with profiler.stage(role, name):
            work()
    profiler.end(step)


def traces(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def names(path: Path) -> set[str]:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_no_profiler_where_profiling_is_off_or_selects_other_ranks(tmp_path):
    assert rank_profiler(None, 0) is None
    assert rank_profiler(settings(tmp_path), 1) is None  # the actor records on rank 0 only
    assert rank_profiler(settings(tmp_path, actor=RoleProfile(None)), 3) is not None  # all ranks


def test_one_trace_per_profiled_step_with_every_stage_labelled(tmp_path):
    profiler = rank_profiler(settings(tmp_path, steps=(2,)), 0)
    for step in (1, 2, 3):
        profiler.begin(step)
        assert (profiler._trace is not None) == (step == 2)  # a torch profiler only for the profiled step
        profiler.end(step)
    run_step(profiler, 2)
    assert traces(tmp_path) == ["step_2/rank_0.pt.trace.json"]
    found = names(tmp_path / "step_2/rank_0.pt.trace.json")
    assert {"megarl/actor/log_prob", "megarl/critic/values", "megarl/actor/update", "aten::mm"} <= found


def test_discrete_traces_each_stage_of_the_enabled_roles_only(tmp_path):
    profiler = rank_profiler(settings(tmp_path, steps=(1,), discrete=True, actor=RoleProfile((0,))), 0)
    run_step(profiler, 1)
    run_step(profiler, 2)  # not profiled
    assert traces(tmp_path) == ["step_1/actor_log_prob/rank_0.pt.trace.json", "step_1/actor_update/rank_0.pt.trace.json"]
    assert "megarl/actor/update" in names(tmp_path / "step_1/actor_update/rank_0.pt.trace.json")


def test_continuous_steps_share_one_trace(tmp_path):
    profiler = rank_profiler(settings(tmp_path, steps=(2, 3, 5), continuous=True), 0)
    for step in range(1, 6):
        run_step(profiler, step)
    assert traces(tmp_path) == ["step_5/rank_0.pt.trace.json", "steps_2-3/rank_0.pt.trace.json"]
    found = [e for e in json.loads((tmp_path / "steps_2-3/rank_0.pt.trace.json").read_text())["traceEvents"]
             if e.get("name") == "megarl/actor/update"]
    assert len(found) == 2  # steps 2 and 3


def test_contents_pick_the_recorders_cpu_always(tmp_path):
    from megarl.trainer.profiling import activities

    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    assert activities(frozenset()) == [cpu]
    assert activities(frozenset({"cpu", "cuda"})) == ([cpu, cuda] if torch.cuda.is_available() else [cpu])
    profiler = rank_profiler(settings(tmp_path, actor=RoleProfile((0,), frozenset({"cpu", "shapes"}))), 0)
    run_step(profiler, 2, stages=(("actor", "update"),))
    events = json.loads((tmp_path / "step_2/rank_0.pt.trace.json").read_text())["traceEvents"]
    assert any("Input Dims" in e.get("args", {}) for e in events if e.get("name") == "aten::mm")  # shapes recorded



def test_a_steps_calls_on_different_threads_make_one_trace(tmp_path):
    """A Ray actor runs each call on one of its pool's threads: begin, the stages and end may each run on
    another thread (kineto crashed when a session stopped on a thread other than the one that started it)."""
    from concurrent.futures import ThreadPoolExecutor

    def stage(name: str) -> None:
        with profiler.stage("actor", name):
            work()

    profiler = rank_profiler(settings(tmp_path), 0)
    with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b:
        a.submit(profiler.begin, 2).result()
        b.submit(stage, "log_prob").result()
        a.submit(stage, "update").result()
        b.submit(profiler.end, 2).result()
    assert traces(tmp_path) == ["step_2/rank_0.pt.trace.json"]
    found = names(tmp_path / "step_2/rank_0.pt.trace.json")
    assert {"megarl/actor/log_prob", "megarl/actor/update", "aten::mm"} <= found


NSYS_SCRIPT = """
import sys, torch
from megarl.settings.profiling import ProfilerSettings, RoleProfile
from megarl.trainer.profiling import rank_profiler
profiler = rank_profiler(ProfilerSettings("nsys", (1,), sys.argv[1], {"actor": RoleProfile((0,))}), 0)
a = torch.randn(256, 256, device="cuda")
profiler.begin(1)
with profiler.stage("actor", "update"):
    (a @ a).sum().item()
profiler.end(1)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA activity needs a GPU")
def test_on_a_gpu_the_trace_holds_the_cuda_kernels(tmp_path):
    profiler = rank_profiler(settings(tmp_path), 0)
    a = torch.randn(256, 256, device="cuda")
    profiler.begin(2)
    with profiler.stage("actor", "update"):
        (a @ a).sum().item()
    profiler.end(2)
    events = json.loads((tmp_path / "step_2/rank_0.pt.trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)


@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nsys") is None, reason="needs a GPU and nsys")
def test_under_nsys_the_profiled_step_is_one_capture_range(tmp_path):
    """What Ray's nsight plugin does for a selected rank, without Ray: nsys waits for the capture range
    the rank profiler opens at the profiled step, and writes its report."""
    import os
    import subprocess
    import sys

    report = tmp_path / "rank0"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run(["nsys", "profile", "-o", str(report), "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
                    "--trace=cuda,nvtx", sys.executable, "-c", NSYS_SCRIPT, str(tmp_path)], check=True, env=env,
                   timeout=300)
    assert report.with_suffix(".nsys-rep").is_file()
