"""Profiling the trainer's workers: verl's ``global_profiler.*`` and ``<role>.profiler.*``, read once here.

``global_profiler.tool`` (``torch`` or ``nsys``) and ``global_profiler.steps`` say what and when;
each role's ``profiler.enable`` with ``all_ranks`` / ``ranks`` (verl's rule: neither given means rank
0) says which trainer ranks record. Actor, reference and critic run in the same worker processes
(one per trainer rank), so:

* ``tool_config.<tool>.discrete=False`` (verl's default): one trace per selected rank and profiled
  step, from the step's first worker call to its last (old log-probs, reference, values, the
  critic's and the actor's updates), each stage labelled ``megarl/<role>/<stage>``; a rank is
  selected when an enabled role selects it. ``profile_continuous_steps`` joins consecutive
  profiled steps into one trace.
* ``discrete=True``: one trace per stage of an enabled role, on the ranks that role selects.

Torch traces are Chrome traces (``*.pt.trace.json``: TensorBoard's profile plugin and Perfetto open
them) under ``global_profiler.save_path`` (default ``<trainer.default_local_dir>/profile``):
``step_<k>/rank_<r>.pt.trace.json``, or ``step_<k>/<role>_<stage>/rank_<r>.pt.trace.json`` when
discrete. ``nsys`` starts the selected ranks under Nsight Systems (Ray's ``runtime_env`` ``nsight``
plugin with ``worker_nsight_options``, as verl does); the workers open a CUDA profiler capture range
per window. When profiling is off nothing is built: ``profiler_settings`` returns None.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config.derived import devices_for
from megarl.config.errors import Problem, refusal
from megarl.settings import plain

TOOLS = ("torch", "nsys")
REFUSED_TOOLS = {  # verl's other tools -> what megarl does instead
    "npu": "Ascend NPU profiling (megarl runs on CUDA GPUs or CPUs): use global_profiler.tool=torch",
    "torch_memory": "torch's CUDA memory snapshots: use global_profiler.tool=torch with "
                    "<role>.profiler.tool_config.torch.contents=[memory] (allocations in the trace)",
    "precision_debugger": "msprobe's precision debugger: megarl logs every step's actor/ and critic/ metrics and "
                          "refuses non-finite weights before a sync or save",
}
CONTENTS = ("cuda", "cpu", "memory", "shapes", "stack")
ROLES = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}
STAGES_PER_STEP = 6  # verl's bound on capture ranges per profiled step (nsys capture-range-end)


@dataclass(frozen=True)
class RoleProfile:
    ranks: tuple[int, ...] | None  # the trainer ranks it records on (None: all)
    contents: frozenset = frozenset(("cpu", "cuda"))  # torch: tool_config.torch.contents ([]: cpu and cuda, verl's)


@dataclass(frozen=True)
class ProfilerSettings:
    tool: str  # torch | nsys
    steps: tuple[int, ...]
    save_dir: str  # absolute: the workers' working directory may differ from the driver's
    roles: dict[str, RoleProfile]  # the enabled roles
    discrete: bool = False
    continuous: bool = False  # profile_continuous_steps (not discrete): consecutive steps share a trace
    nsight_options: dict = field(default_factory=dict)  # nsys: Ray's runtime_env "nsight" value

    def profiles(self, step: int) -> bool:
        return step in self.steps

    def role_on(self, role: str, rank: int) -> bool:
        if role not in self.roles:
            return False
        ranks = self.roles[role].ranks
        return ranks is None or rank in ranks

    def contents(self, rank: int, role: str | None = None) -> frozenset:
        """What a trace on ``rank`` records: ``role``'s contents, or (one trace per step) those of every
        enabled role that records on the rank."""
        roles = [role] if role is not None else [r for r in self.roles if self.role_on(r, rank)]
        return frozenset().union(*(self.roles[r].contents for r in roles))

    def on_rank(self, rank: int) -> bool:
        """Some enabled role records on ``rank``."""
        return any(self.role_on(role, rank) for role in self.roles)

    def window(self, step: int) -> tuple[int, int]:
        """The first and last step of the trace ``step`` belongs to (non-discrete)."""
        first = last = step
        if self.continuous:
            while first - 1 in self.steps:
                first -= 1
            while last + 1 in self.steps:
                last += 1
        return first, last

    def runtime_env(self, rank: int) -> dict | None:
        """Ray ``runtime_env`` of trainer rank ``rank``: nsys runs the selected ranks under Nsight."""
        if self.tool != "nsys" or not self.on_rank(rank):
            return None
        return {"nsight": dict(self.nsight_options)}


def nsight_options(given: dict, steps: int) -> dict:
    """verl's worker_nsight_options as Ray's nsight plugin takes them: no null values; an open
    ``capture-range-end`` ends after the profiled steps' ranges (verl: ``repeat-shutdown:6 x steps``)."""
    options = {str(k): str(v) for k, v in given.items() if v is not None}
    if given.get("capture-range-end", None) is None and options.get("capture-range") == "cudaProfilerApi":
        options["capture-range-end"] = f"repeat-shutdown:{STAGES_PER_STEP * steps}"
    return options


def _role_sections(cfg) -> dict[str, Any]:
    return {"actor": cfg.actor_rollout_ref.actor.profiler, "ref": cfg.actor_rollout_ref.ref.profiler,
            "critic": cfg.critic.profiler}


def _enabled(cfg) -> dict[str, Any]:
    """The roles whose profiler is on, when the tool and steps ask for profiling at all."""
    g = cfg.global_profiler
    if g.tool is None or not g.steps:
        return {}
    return {role: p for role, p in _role_sections(cfg).items() if p.enable}


def _selected_ranks(p) -> tuple[int, ...] | None:
    if p.all_ranks:
        return None
    return tuple(int(r) for r in p.ranks) if p.ranks else (0,)


def _discrete(cfg, p, tool: str) -> bool:
    if tool == "torch":
        return bool(p.tool_config.torch.discrete)
    given = p.tool_config.nsys.discrete
    return bool(cfg.global_profiler.global_tool_config.nsys.discrete if given is None else given)


def profiler_problems(cfg) -> list[Problem]:
    """Every profiler setting megarl cannot honour, one line each (``megarl.checks`` reports them)."""
    g, problems = cfg.global_profiler, []
    if g.tool in REFUSED_TOOLS:  # refused where it would record (verl's templates name it with steps=null)
        if not _enabled(cfg):
            return []
        return [refusal(f"global_profiler.tool={g.tool}", f"the {g.tool} profiler", REFUSED_TOOLS[g.tool])]
    if g.tool is not None and g.tool not in TOOLS:
        return [Problem(f"global_profiler.tool={g.tool!r}: use torch or nsys (or null: no profiling)",
                        key="global_profiler.tool")]
    if any(int(s) < 1 for s in g.steps or ()):
        problems.append(Problem(f"global_profiler.steps={list(g.steps)}: steps count from 1", key="global_profiler.steps"))
    enabled = _enabled(cfg)
    for role, p in _role_sections(cfg).items():
        key = f"{ROLES[role]}.profiler"
        if p.tool is not None and p.tool != g.tool:
            problems.append(refusal(f"{key}.tool={p.tool}", "a profiler tool per role", "every role uses "
                                    f"global_profiler.tool ({g.tool}): the roles share their worker processes"))
        if p.save_path is not None and p.save_path != g.save_path:
            problems.append(refusal(f"{key}.save_path={p.save_path}", "a trace directory per role",
                                    "every trace goes under global_profiler.save_path (step_<k>/...)"))
        unknown = [c for c in p.tool_config.torch.contents if c not in CONTENTS]
        if unknown:
            problems.append(Problem(f"{key}.tool_config.torch.contents has {unknown}: use some of {list(CONTENTS)}",
                                    key=f"{key}.tool_config.torch.contents"))
        if p.tool_config.torch.schedule.active > 0:
            problems.append(refusal(f"{key}.tool_config.torch.schedule.active={p.tool_config.torch.schedule.active}",
                                    "recording a window of update mini-batches", "megarl records each profiled "
                                    "stage whole; pick the steps with global_profiler.steps"))
        if role in enabled and p.ranks and not p.all_ranks:
            problems += _rank_problems(cfg, key, [int(r) for r in p.ranks])
    if enabled and len({_discrete(cfg, p, g.tool) for p in enabled.values()}) > 1:
        problems.append(Problem(f"tool_config.{g.tool}.discrete differs between {sorted(enabled)}: actor, ref and "
                                "critic share their worker processes, so one trace layout serves them; give them one "
                                "value", key=f"{ROLES[sorted(enabled)[0]]}.profiler.tool_config"))
    elif enabled and g.profile_continuous_steps and _discrete(cfg, next(iter(enabled.values())), g.tool):
        problems.append(Problem("global_profiler.profile_continuous_steps=True with discrete=True: a trace per stage "
                                "cannot span steps; set one of them False", key="global_profiler.profile_continuous_steps"))
    if enabled and g.tool == "nsys" and shutil.which("nsys") is None:
        problems.append(refusal("global_profiler.tool=nsys", "Nsight Systems profiling on a host without nsys",
                                "install Nsight Systems so that `nsys` is on PATH on every node, or use "
                                "global_profiler.tool=torch (a torch profiler trace per rank and step)"))
    return problems


def _rank_problems(cfg, key: str, ranks: list[int]) -> list[Problem]:
    try:
        world = devices_for(cfg)[0]
    except ValueError:  # the cluster's shape is wrong: its own check says so
        return []
    if all(0 <= r < world for r in ranks):
        return []
    return [Problem(f"{key}.ranks={ranks}: the trainer has ranks 0..{world - 1}", key=f"{key}.ranks")]


def profiler_settings(cfg) -> ProfilerSettings | None:
    """What the workers and the controller do about profiling; None when nothing is profiled (no cost)."""
    enabled = _enabled(cfg)
    if not enabled:
        return None
    g = cfg.global_profiler
    tool = str(g.tool)
    first = next(iter(enabled.values()))
    save = Path(g.save_path) if g.save_path else Path(cfg.trainer.default_local_dir) / "profile"
    steps = tuple(sorted({int(s) for s in g.steps}))
    return ProfilerSettings(
        tool=tool, steps=steps, save_dir=str(save.absolute()),
        roles={role: RoleProfile(_selected_ranks(p), frozenset(str(c) for c in p.tool_config.torch.contents)
                                 or frozenset(("cpu", "cuda"))) for role, p in enabled.items()},
        discrete=_discrete(cfg, first, tool), continuous=bool(g.profile_continuous_steps),
        nsight_options=nsight_options(plain(g.global_tool_config.nsys.worker_nsight_options) or {}, len(steps))
        if tool == "nsys" else {})
