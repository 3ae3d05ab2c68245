"""``agent.num_workers > 0``: agent loops run in Ray actors instead of the controller process.

Each ``AgentLoopWorker`` builds its own tokenizer, tools and loops from the run's ``AgentSettings`` (so a tool's
processes and a loop's tokenisation load that actor, not the controller) and runs the trajectories
it is given concurrently, calling the engine replicas directly through the ``GenerateClient`` of
each job. The actors take no CPU from the placement (``num_cpus=0``): their work is light next to
the engines and the trainer, and they must never keep either from being placed.
"""
from __future__ import annotations

from typing import Any, Sequence

from megarl.agent.settings import AgentSettings


class AgentLoopWorker:
    def __init__(self, settings: AgentSettings, tokenizer_path: str, index: int = 0):
        from megarl.logging.worker_logs import capture_worker_output

        capture_worker_output(f"agent_worker{index}")
        from transformers import AutoTokenizer

        from megarl.agent.rollout import LoopSet, build_agent_context

        self.loops = LoopSet(build_agent_context(settings, AutoTokenizer.from_pretrained(tokenizer_path)))

    async def run(self, jobs: Sequence[tuple[str, Any, Any]]) -> list:
        return await self.loops.run(jobs)


def start_workers(settings: AgentSettings, tokenizer_path: str, count: int) -> list:
    import ray

    actor = ray.remote(AgentLoopWorker)
    return [actor.options(num_cpus=0).remote(settings, tokenizer_path, index) for index in range(count)]


def run_on_workers(workers: list, jobs: list) -> list:
    """Jobs split into contiguous runs of whole prompts, one per worker; results in job order."""
    import ray

    from megarl.rollout.fleet import split_evenly

    prompts: list[list] = []
    for job in jobs:  # jobs come prompt by prompt; keep a prompt's samples on one worker
        if not prompts or prompts[-1][0][1].prompt_index != job[1].prompt_index:
            prompts.append([])
        prompts[-1].append(job)
    refs = []
    for worker, chunk in zip(workers, split_evenly(len(prompts), len(workers))):
        if len(chunk):
            refs.append(worker.run.remote([job for p in chunk for job in prompts[p]]))
    return [t for part in ray.get(refs) for t in part]
