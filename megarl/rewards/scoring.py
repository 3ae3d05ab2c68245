"""Calling a reward function on samples, wherever that runs (the controller, a thread, a worker process).

A sample is ``(data_source, solution_str, ground_truth, extra_info, context)``: ``context`` holds
the reward-model arguments the function takes. Every call ends in an outcome:

* ``("ok", score, extras, was_dict)``;
* ``("error", "Type: message", traceback)``: the function raised;
* ``("judge", message, timed_out)``: the judge failed after its retries, or a ``rate_limited`` call
  ran past ``reward_model.timeout`` (scored ``reward_model.judge.fallback_score``);
* ``("timeout", message)``: the call ran past ``reward.compute_score_timeout`` and was stopped;
* ``("bad_return", description)``: the function returned something that is not a score.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as futures
import functools
import inspect
import math
import numbers
import queue
import threading
import time
import traceback
from typing import Any, Callable

from megarl.rewards.reward_models.judge import JudgeError
from megarl.rewards.rate_limit import CallTimedOut, LimitSettings, RateLimits


def timeout_outcome(timeout_s: float, where: str = "") -> tuple:
    return ("timeout", f"the reward function ran longer than reward.compute_score_timeout={timeout_s:g} s{where}")


def score_one(fn: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any, extra_info: Any,
              context: dict[str, Any]) -> tuple:
    try:
        value = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info,
                   **context)
    except Exception as exc:
        return error_outcome(exc)
    return check_value(value)


def error_outcome(exc: BaseException) -> tuple:
    if isinstance(exc, (JudgeError, CallTimedOut)):
        return ("judge", f"{type(exc).__name__}: {exc}", isinstance(exc, CallTimedOut))
    return ("error", f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))


def check_value(value: Any) -> tuple:
    extras: dict[str, Any] = {}
    was_dict = isinstance(value, dict)
    if was_dict:
        if "score" not in value:
            return ("bad_return", f"a dict without a 'score' key (keys: {sorted(value)})")
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()  # numpy scalars, 0-d tensors
        except (TypeError, ValueError):
            pass
    if not isinstance(value, numbers.Real):  # bool counts (True -> 1.0)
        return ("bad_return", f"{type(value).__name__} {value!r:.80}")
    if not math.isfinite(float(value)):
        return ("bad_return", f"a non-finite score {value!r}")
    return ("ok", float(value), extras, was_dict)


def is_async(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, "is_async", False)) or inspect.iscoroutinefunction(fn)


def score_async(fn: Callable[..., Any], samples: list[tuple], timeout_s: float | None) -> list[tuple]:
    """An ``async def`` function: every sample awaited concurrently, each cancelled after ``timeout_s``."""
    async def one(sample: tuple) -> tuple:
        data_source, solution_str, ground_truth, extra_info, context = sample
        try:
            value = await asyncio.wait_for(fn(data_source=data_source, solution_str=solution_str,
                                              ground_truth=ground_truth, extra_info=extra_info, **context), timeout_s)
        except asyncio.TimeoutError:
            return timeout_outcome(timeout_s, " (cancelled)")
        except Exception as exc:
            return error_outcome(exc)
        return check_value(value)

    async def every() -> list[tuple]:
        return list(await asyncio.gather(*(one(sample) for sample in samples)))

    return asyncio.run(every())


def score_in_threads(fn: Callable[..., Any], samples: list[tuple], num_threads: int, timeout_s: float | None,
                     done: Callable[[int], None] = lambda count: None) -> list[tuple]:
    """Sync calls in ``num_threads`` daemon threads. A call past ``timeout_s`` scores a timeout; a thread
    cannot be stopped, so it is left to finish in the background (its result ignored; a daemon, it never
    holds up the exit) and another thread takes its place."""
    jobs, results = queue.SimpleQueue(), queue.SimpleQueue()
    for index in range(len(samples)):
        jobs.put(index)
    started: dict[int, float] = {}

    def work() -> None:
        while True:
            try:
                index = jobs.get_nowait()
            except queue.Empty:
                return
            started[index] = time.monotonic()
            results.put((index, score_one(fn, *samples[index])))

    def add_thread() -> None:
        threading.Thread(target=work, daemon=True, name="megarl-reward").start()

    for _ in range(min(num_threads, len(samples))):
        add_thread()
    outcomes: list[tuple | None] = [None] * len(samples)
    left = len(samples)
    while left:
        try:
            index, outcome = results.get(timeout=0.2)
            if outcomes[index] is None:
                outcomes[index], left = outcome, left - 1
                done(1)
        except queue.Empty:
            pass
        now = time.monotonic()
        for index, since in list(started.items()):
            if timeout_s and outcomes[index] is None and now - since > timeout_s:
                outcomes[index], left = timeout_outcome(timeout_s, " (its thread is left running: "
                                                                   "reward.executor=process stops such calls)"), left - 1
                done(1)
                add_thread()
    return outcomes  # type: ignore[return-value]


def score_limited(fn: Callable[..., Any], samples: list[tuple], limits: LimitSettings) -> list[tuple]:
    """The ``rate_limited`` manager: every call of the batch at once, within the limits."""
    asynchronous = is_async(fn)

    async def every() -> list[tuple]:
        gate, loop = RateLimits(limits), asyncio.get_running_loop()
        threads = None if asynchronous else futures.ThreadPoolExecutor(limits.max_concurrent, "reward-limited")

        async def one(sample: tuple) -> tuple:
            data_source, solution_str, ground_truth, extra_info, context = sample
            call = functools.partial(fn, data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                     extra_info=extra_info, **context)
            try:
                value = await gate.run(call if asynchronous else lambda: loop.run_in_executor(threads, call))
            except Exception as exc:
                return error_outcome(exc)
            return check_value(value)

        try:
            return list(await asyncio.gather(*(one(sample) for sample in samples)))
        finally:
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)  # a call past its time limit keeps its thread

    return asyncio.run(every())


def score_batch(fn: Any, samples: list[tuple], context: dict[str, Any]) -> list[tuple]:
    """One call for the batch (batch-form functions); its result checked element by element."""
    columns = [list(column) for column in zip(*samples)][:4] if samples else [[], [], [], []]
    try:
        result = fn.score_batch(*columns, **context)
        if inspect.isawaitable(result):
            async def wait() -> Any:
                return await result

            result = asyncio.run(wait())
    except Exception as exc:
        return [error_outcome(exc)] * len(samples)
    if hasattr(result, "tolist") and not isinstance(result, (list, tuple)):
        result = result.tolist()  # numpy arrays, tensors
    if not isinstance(result, (list, tuple)) or len(result) != len(samples):
        what = f"{len(result)} values" if isinstance(result, (list, tuple)) else f"a {type(result).__name__}"
        return [("bad_return", f"{what} for a batch of {len(samples)} responses (a batch reward function returns "
                               "a list with one score or dict per response)")] * len(samples)
    return [check_value(value) for value in result]
