"""The rollout seam the controller calls: prompts in, one ``Trajectory`` per sample out.

    settings = agent_settings(cfg)                         # megarl.settings.agent, at the door
    context = build_agent_context(settings, tokenizer)    # tools loaded and checked: before any process starts
    rollout = AgentRollout(context, fleet, sampling)      # sampling: the rollout's SamplingDefaults
    trajectories = rollout.generate(prompt_columns, step=3)   # n per prompt, in prompt then sample order

Every sample runs the agent loop its row names (``agent_name``) or ``agent.default_agent_loop``;
all trajectories of a call run concurrently, each loop's engine calls going to the replica that
``RolloutFleet.replica_for`` gives its prompt (sticky: all its samples and turns share that
replica's prefix cache). Results depend only on the seeds (``rollout.seed``, step, prompt index,
sample index, turn), never on the replica or on timing.

``agent.num_workers``: 0 (megarl's default) runs the loops in this process with asyncio; N > 0
runs them in N Ray actors (``AgentLoopWorker``), prompts split evenly, each with its own tokenizer
and tools: for rollouts whose tokenisation or tool work would load one process.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping, Sequence

from megarl.agent.loop import AgentContext, AgentSample, check_loop_name, resolve_agent_loop
from megarl.agent.settings import AgentSettings, MultiTurnSettings
from megarl.agent.trajectory import Trajectory
from megarl.rollout.sampling import resolve_sampling

logger = logging.getLogger(__name__)

def build_tools(settings: MultiTurnSettings):
    """The ``ToolSet`` of ``multi_turn.tool_config_path`` + ``function_tool_path`` (None without either)."""
    from megarl.agent.tools.config import load_function_tools, load_tool_config
    from megarl.agent.tools.toolset import ToolSet

    tools = []
    if settings.tool_config_path:
        tools += load_tool_config(settings.tool_config_path)
    if settings.function_tool_path:
        tools += load_function_tools(settings.function_tool_path)
    if not tools:
        return None
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tool names {duplicates} are defined twice (tool_config_path / function_tool_path); "
                         "every tool needs its own name")
    return ToolSet({t.name: t for t in tools}, settings.tool_timeout_s)


def build_agent_context(settings: AgentSettings, tokenizer: Any) -> AgentContext:
    """The loops' shared context; the tools are built (and checked) here."""
    tools = build_tools(settings.multi_turn) if settings.multi_turn.enable else None
    return AgentContext(tokenizer=tokenizer, response_length=settings.response_length, multi_turn=settings.multi_turn,
                        tools=tools, chat_template_kwargs=dict(settings.chat_template_kwargs),
                        loop_paths=dict(settings.loop_paths), default_loop=settings.default_loop)


def tool_schemas_for(loops: "LoopSet", default_loop: str):
    """For the dataset: the tool schemas to render into a row's prompt, given the row's ``agent_name``.

    Building the loop here also checks, before any process starts, that the name is one the config
    offers (``LoopSet.get``: nothing a row names is imported otherwise) and that a tool loop has tools.
    """
    loops.get(default_loop)  # the config's loop first: a module it loads may register the names rows use

    def schemas(loop_name: str | None) -> list | None:
        loop = loops.get(loop_name or default_loop)
        return loops.context.tools.schemas if loop.uses_tools and loops.context.tools else None
    return schemas


class LoopSet:
    """One instance of each agent loop a run uses, built on first use; only loops the config offers
    (``megarl.agent.loop.allowed_loop_names``), so a name from the data never imports anything."""

    def __init__(self, context: AgentContext):
        self.context = context
        self._loops: dict[str, Any] = {}

    def get(self, name: str):
        if name not in self._loops:
            check_loop_name(name, self.context)
            self._loops[name] = resolve_agent_loop(self.context.loop_paths.get(name, name))(self.context)
        return self._loops[name]

    async def run(self, jobs: Sequence[tuple[str, AgentSample, Any]]) -> list[Trajectory]:
        """Every job's trajectory, in job order; the samples of one prompt go to a grouping loop together."""
        async def one(name: str, samples: list[AgentSample], client) -> list[Trajectory]:
            loop = self.get(name)
            try:
                if loop.groups_samples:
                    return await loop.run_group(samples, client)
                return [await loop.run(samples[0], client)]
            except Exception as exc:
                sample = samples[0]
                which = f"sample {sample.sample_index}" if len(samples) == 1 else f"samples {sample.sample_index}-{samples[-1].sample_index}"
                raise RuntimeError(f"agent loop {name!r} failed on prompt {sample.prompt_index} {which} "
                                   f"(step {sample.step}): {type(exc).__name__}: {exc}") from exc

        groups: list[tuple[str, list[AgentSample], Any]] = []
        for name, sample, client in jobs:
            last = groups[-1] if groups else None
            if (last is not None and last[0] == name and last[2] is client and self.get(name).groups_samples
                    and last[1][-1].prompt_index == sample.prompt_index and last[1][-1].step == sample.step
                    and last[1][-1].sample_index + 1 == sample.sample_index):
                last[1].append(sample)
            else:
                groups.append((name, [sample], client))
        results = await asyncio.gather(*[one(*group) for group in groups])
        return [trajectory for group in results for trajectory in group]


class AgentRollout:
    """``rollout`` is the typed ``actor_rollout_ref.rollout`` section (``megarl.config.schema.RolloutConfig``):
    its sampling (``val_kwargs`` for validation), ``seed`` and ``agent.num_workers``."""

    def __init__(self, context: AgentContext, fleet, rollout: Any, num_workers: int | None = None,
                 worker_factory=None, loops: LoopSet | None = None):
        self.context, self.fleet, self.config = context, fleet, rollout
        self.default_loop = context.default_loop or "single_turn_agent"
        self.loops = loops or LoopSet(context)
        self.loops.get(self.default_loop)  # an unknown default or a tool loop without tools fails here
        self.num_workers = int(rollout.agent.num_workers if num_workers is None else num_workers)
        self.workers = worker_factory(self.num_workers) if self.num_workers > 0 and worker_factory else []
        if self.num_workers > 0 and not self.workers:
            raise ValueError("agent.num_workers > 0 needs a worker factory (megarl.agent.workers.start_workers)")
        self.last_stats: dict[str, float] = {}

    def loop_names(self, prompts: Mapping[str, list]) -> list[str]:
        names = prompts.get("agent_name") or [None] * len(prompts["prompt_ids"])
        return [name or self.default_loop for name in names]

    def generate(self, prompts: Mapping[str, list], *, step: int, n: int | None = None, validate: bool = False,
                 sampling: Mapping[str, Any] | None = None, prompt_offset: int = 0) -> list[Trajectory]:
        """``n`` trajectories per prompt (``rollout.n``; ``val_kwargs.n`` with ``validate``), ordered by
        prompt, then sample. ``prompt_offset`` numbers the prompts after those of earlier calls of
        the same step (DAPO's extra batches), so their seeds differ."""
        count = len(prompts["prompt_ids"])
        jobs = self._jobs(prompts, resolve_sampling(self.config, sampling, n, validate), step, prompt_offset,
                          [self.fleet.replica_for(i, count) for i in range(count)])
        start = time.perf_counter()
        if self.workers:
            from megarl.agent.workers import run_on_workers

            trajectories = run_on_workers(self.workers, jobs)
        else:
            trajectories = asyncio.run(self.loops.run(jobs))
        seconds = time.perf_counter() - start
        tokens = sum(t.num_model_tokens for t in trajectories)
        self.last_stats = dict(samples=len(trajectories), model_tokens=tokens, seconds=seconds,
                               tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
        logger.info("rollout: %d trajectories (%s) in %.2f s, %d model tokens, %.0f tok/s", len(trajectories),
                    ", ".join(sorted({job[0] for job in jobs})), seconds, tokens, self.last_stats["tokens_per_s"])
        return trajectories

    async def agenerate(self, prompts: Mapping[str, list], *, step: int, prompt_index: int, replica: int,
                        n: int | None = None) -> list[Trajectory]:
        """One prompt's ``n`` trajectories, awaited in the caller's event loop (the asynchronous
        trainer's producer): the seeds of prompt ``prompt_index`` of step ``step`` and the given
        replica, so that it samples what ``generate`` samples for that prompt of that step."""
        jobs = self._jobs(prompts, resolve_sampling(self.config, None, n, False), step, prompt_index, [replica])
        if self.workers:
            return list(await self.workers[prompt_index % len(self.workers)].run.remote(jobs))
        return await self.loops.run(jobs)

    def _jobs(self, prompts: Mapping[str, list], params, step: int, prompt_offset: int,
              replicas: list[int]) -> list[tuple[str, AgentSample, Any]]:
        names = self.loop_names(prompts)
        jobs = []
        for i, replica in enumerate(replicas):
            client = self.fleet.client(replica)
            for k in range(params.n):
                sample = AgentSample(prompt_ids=list(prompts["prompt_ids"][i]), messages=list(prompts["raw_prompt"][i]),
                                     extra_info=dict(prompts["extra_info"][i] or {}), prompt_index=prompt_offset + i,
                                     sample_index=k, step=step, base_seed=int(self.config.seed), sampling=params,
                                     images=tuple((prompts.get("images") or [()] * len(replicas))[i] or ()))
                jobs.append((names[i], sample, client))
        return jobs

    def close(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
