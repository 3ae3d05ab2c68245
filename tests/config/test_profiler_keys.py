"""verl's profiler keys (``global_profiler.*``, ``<role>.profiler.*``): what megarl.settings.profiling makes
of them, and every form it cannot honour refused before start."""
from __future__ import annotations

from pathlib import Path

import pytest

import megarl.settings.profiling as profiling
from megarl.checks import ConfigError, load_config
from megarl.settings.profiling import nsight_options, profiler_settings

ACTOR, REF, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout"
VALID = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
         "trainer.n_gpus_per_node=2", "data.train_batch_size=4", f"{ROLLOUT}.n=2",
         f"{ACTOR}.ppo_mini_batch_size=2", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2",
         f"{ROLLOUT}.tensor_model_parallel_size=1", "trainer.default_local_dir=/runs/r1"]
TORCH_STEP_2 = ["global_profiler.tool=torch", "global_profiler.steps=[2]", f"{ACTOR}.profiler.enable=True"]


def load(*overrides: str):
    return load_config(None, [*VALID, *overrides])


def problems(*overrides: str) -> list:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    return info.value.problems


@pytest.mark.parametrize("overrides", [
    [],  # verl's defaults: tool null, steps null, every enable False
    ["global_profiler.tool=torch", f"{ACTOR}.profiler.enable=True"],  # no steps
    ["global_profiler.tool=torch", "global_profiler.steps=[1]"],  # no role enabled
    ["global_profiler.steps=[1]", f"{ACTOR}.profiler.enable=True"],  # no tool
])
def test_profiling_is_off_unless_a_tool_steps_and_a_role_ask_for_it(overrides):
    assert profiler_settings(load(*overrides)) is None  # nothing is built: no cost


def test_torch_on_the_actor_at_step_2_records_rank_0_under_the_run_directory():
    s = profiler_settings(load(*TORCH_STEP_2))
    assert (s.tool, s.steps, s.discrete, s.continuous) == ("torch", (2,), False, False)
    assert s.save_dir == "/runs/r1/profile" and s.profiles(2) and not s.profiles(1)
    assert s.on_rank(0) and not s.on_rank(1)  # verl: ranks [] and all_ranks False is rank 0
    assert s.contents(0) == {"cpu", "cuda"}  # contents [] is cpu and cuda, as verl's
    assert s.runtime_env(0) is None  # torch needs no runtime environment


def test_ranks_all_ranks_roles_and_a_relative_save_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = profiler_settings(load("global_profiler.tool=torch", "global_profiler.steps=[1,3,4]",
                               "global_profiler.profile_continuous_steps=True", "global_profiler.save_path=out/prof",
                               f"{ACTOR}.profiler.enable=True", f"{ACTOR}.profiler.ranks=[1]",
                               f"{ACTOR}.profiler.tool_config.torch.contents=[cpu,shapes]",
                               f"{ACTOR}.use_kl_loss=True", f"{REF}.log_prob_micro_batch_size_per_gpu=2",
                               f"{REF}.profiler.enable=True", f"{REF}.profiler.all_ranks=True"))
    assert Path(s.save_dir) == tmp_path / "out" / "prof"  # absolute: the workers' cwd may differ
    assert set(s.roles) == {"actor", "ref"} and s.roles["actor"].ranks == (1,) and s.roles["ref"].ranks is None
    assert s.role_on("actor", 1) and not s.role_on("actor", 0) and s.role_on("ref", 0)
    assert s.contents(1) == {"cpu", "shapes", "cuda"} and s.contents(1, "actor") == {"cpu", "shapes"}
    assert [s.window(k) for k in (1, 3, 4)] == [(1, 1), (3, 4), (3, 4)]


@pytest.mark.parametrize("override, feature", [
    ("global_profiler.tool=npu", "the npu profiler"),
    ("global_profiler.tool=torch_memory", "the torch_memory profiler"),
    ("global_profiler.tool=precision_debugger", "the precision_debugger profiler"),
    (f"{ROLLOUT}.profiler.enable=True", "profiling the rollout or reward-model engines"),
    ("reward_model.profiler.enable=True", "profiling the rollout or reward-model engines"),
    ("global_profiler.finish_hook_cmd='upload.sh'", "a command run on the workers after profiling"),
    (f"{ACTOR}.profiler.relocate_results=True", "moving nsys reports out of Ray's session directory"),
    (f"{ACTOR}.profiler.tool_config.torch.profile_token_start=4", "profiling a window of response tokens (the rollout's)"),
    (f"{ACTOR}.profiler.tool_config.torch.schedule.active=2", "recording a window of update mini-batches"),
    (f"{ACTOR}.profiler.tool=nsys", "a profiler tool per role"),
    (f"{ACTOR}.profiler.save_path=/elsewhere", "a trace directory per role"),
])
def test_what_megarl_cannot_honour_is_refused_by_name(override, feature):
    found = [p for p in problems(*TORCH_STEP_2, override) if p.is_refusal]
    assert [p.feature for p in found] == [feature], [p.message for p in found]
    assert override.split("=")[0] in found[0].message


@pytest.mark.parametrize("overrides, message", [
    ([f"{ACTOR}.profiler.ranks=[2]"], "actor_rollout_ref.actor.profiler.ranks=[2]: the trainer has ranks 0..1"),
    ([f"{ACTOR}.profiler.tool_config.torch.contents=[gpu]"], "contents has ['gpu']: use some of"),
    (["global_profiler.steps=[0]"], "global_profiler.steps=[0]: steps count from 1"),
    ([f"{ACTOR}.use_kl_loss=True", f"{REF}.log_prob_micro_batch_size_per_gpu=2", f"{REF}.profiler.enable=True",
      f"{REF}.profiler.tool_config.torch.discrete=True"],
     "tool_config.torch.discrete differs between ['actor', 'ref']"),
    ([f"{ACTOR}.profiler.tool_config.torch.discrete=True", "global_profiler.profile_continuous_steps=True"],
     "a trace per stage cannot span steps"),
])
def test_settings_that_cannot_work_name_the_key(overrides, message):
    (problem,) = problems(*TORCH_STEP_2, *overrides)
    assert message in problem.message and not problem.is_refusal


def test_nsys_is_refused_before_start_where_it_is_not_installed(monkeypatch):
    monkeypatch.setattr(profiling.shutil, "which", lambda name: None)
    (refused,) = problems("global_profiler.tool=nsys", "global_profiler.steps=[1]", f"{ACTOR}.profiler.enable=True")
    assert refused.feature == "Nsight Systems profiling on a host without nsys"
    assert "`nsys` is on PATH" in refused.message and "global_profiler.tool=torch" in refused.message
    load("global_profiler.tool=nsys")  # asks for nothing while no step and no role is profiled
    load("global_profiler.tool=npu", "global_profiler.steps=null", f"{ACTOR}.profiler.enable=True")  # nor npu


def test_nsys_runs_the_selected_ranks_under_rays_nsight_plugin(monkeypatch):
    monkeypatch.setattr(profiling.shutil, "which", lambda name: "/opt/nsight/bin/nsys")
    s = profiler_settings(load("global_profiler.tool=nsys", "global_profiler.steps=[2,5]",
                               f"{ACTOR}.profiler.enable=True", f"{ACTOR}.profiler.ranks=[1]",
                               "global_profiler.global_tool_config.nsys.discrete=True",
                               "global_profiler.global_tool_config.nsys.worker_nsight_options.trace='cuda,nvtx'"))
    assert s.tool == "nsys" and s.discrete  # the role's discrete defaults to the global one
    assert s.runtime_env(0) is None
    env = s.runtime_env(1)
    assert env == {"nsight": {"trace": "cuda,nvtx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph",
                              "capture-range": "cudaProfilerApi", "capture-range-end": "repeat-shutdown:12",
                              "kill": "none"}}


def test_nsight_options_keep_a_given_capture_end_and_drop_nulls():
    given = {"trace": "cuda", "capture-range": "cudaProfilerApi", "capture-range-end": "stop", "sample": None}
    assert nsight_options(given, 3) == {"trace": "cuda", "capture-range": "cudaProfilerApi", "capture-range-end": "stop"}
    assert nsight_options({"trace": "cuda"}, 3) == {"trace": "cuda"}  # no capture range: nsys records throughout
