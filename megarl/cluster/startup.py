"""Start the trainer ranks and the rollout fleet at the same time, and the run's reward model.

Both take seconds to minutes (the ranks import megatron-core and build their models; each engine
replica imports vLLM in three processes and loads the model), and neither needs the other until the
weight sync connects them, so they start side by side:

    started = start_together(workers=lambda: WorkerGroup(...), fleet=lambda: RolloutFleet(...))
    workers, fleet = started["workers"], started["fleet"]

Each starter runs in its own thread (Ray's driver API is thread-safe). If one fails, the others are
still waited for, whatever did start is shut down (its ``close`` or ``shutdown``), and the first
error is raised, so a failed start leaves no actors behind.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from megarl.rewards.reward_models.service import RewardModelService

logger = logging.getLogger(__name__)


def start_together(timings: dict[str, float] | None = None, **starters: Callable[[], Any]) -> dict[str, Any]:
    """Call every starter concurrently; return their results by name, or raise the first failure.
    ``timings``, if given, receives each starter's seconds by name."""
    start = time.perf_counter()
    seconds: dict[str, float] = {} if timings is None else timings

    def timed(name: str, starter: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        try:
            return starter()
        finally:
            seconds[name] = time.perf_counter() - began

    with ThreadPoolExecutor(max_workers=len(starters), thread_name_prefix="megarl-start") as pool:
        futures = {name: pool.submit(timed, name, starter) for name, starter in starters.items()}
        results, errors = {}, []
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except BaseException as exc:  # wait for the others before cleaning up
                errors.append((name, exc))
    if errors:
        for name, started in results.items():
            try:
                (getattr(started, "close", None) or started.shutdown)()
            except Exception as exc:  # keep the original error
                logger.warning("shutting down %s after a failed start: %s", name, exc)
        raise errors[0][1]
    logger.info("started %s side by side in %.1f s (%s)", " and ".join(starters), time.perf_counter() - start,
                ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()))
    return results


def start_reward_model(settings: Any, engine: Any, pool_plan: Any, placement: Any, use_gpu: bool
                       ) -> tuple[RewardModelService | None, Any]:
    """The run's reward model (None when ``settings`` is None: no ``reward_model.enable``) and the placement
    of its own pool (None when colocated on the trainer's slots), both to close when the run ends.
    ``engine`` is its fleet's typed ``reward_model.rollout`` section; ``pool_plan`` its own devices, or None."""
    from megarl.cluster.placement import ClusterPlacement
    from megarl.rewards.reward_models.service import RewardModelService

    if settings is None:
        return None, None
    pool = ClusterPlacement(pool_plan, use_gpu) if pool_plan is not None else None
    try:
        service = RewardModelService(settings, engine, (pool or placement).reward_slots(), use_gpu=use_gpu,
                                     sleep_mode=pool is None and bool(engine.free_cache_engine))
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    return service, pool
