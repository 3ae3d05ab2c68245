"""The reward manager: scores a batch of decoded responses, sequentially or in parallel.

Each sample is scored with ``compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=...)``. A function that raises scores 0 for that
sample; the error is logged and counted in the metrics (``reward/num_errors``,
``reward/first_error``), unless ``on_error="raise"``, which stops with the
sample's index and the exception. A function that returns something other than a
finite number or a dict with a finite ``"score"`` is a bug in the function, so it
always raises.

Parallel scoring (``num_workers > 1``) splits the batch into chunks and scores
them in a pool of worker processes (default; real parallelism for CPU-bound
rules) or threads (for functions that wait on I/O, e.g. a remote judge). The
result does not depend on the number of workers.

A batch-form function (see :mod:`megarl.rewards.custom`) is called once with the whole batch,
in the calling process. An ``async def`` function's calls are awaited concurrently, per chunk.

Config keys read by :meth:`RewardManager.from_config`: ``custom_reward_function.*``
(see :mod:`megarl.rewards.custom`), ``reward.num_workers`` [1], ``reward.executor``
["process"], ``reward.on_error`` ["zero"], ``reward_model.reward_manager`` ["naive"] and the
dapo manager's ``reward_kwargs`` (see :mod:`megarl.rewards.managers`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as futures
import inspect
import logging
import math
import multiprocessing
import numbers
import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megarl.rewards.custom import SAMPLE, _get, form_of, load_reward_function
from megarl.rewards.managers import OverlongPenalty, function_kwargs, manager_name, overlong_penalty
from megarl.rewards.registry import default_compute_score

logger = logging.getLogger(__name__)

ON_ERROR_MODES = ("zero", "raise")
EXECUTORS = ("process", "thread")


class RewardFunctionError(RuntimeError):
    """A reward function raised (with ``on_error="raise"``) or returned a value of the wrong type."""


@dataclass(frozen=True)
class SampleError:
    index: int
    data_source: str
    error: str  # "ExceptionType: message"
    traceback: str


@dataclass
class RewardResult:
    scores: list[float]  # one per sample; 0.0 where the function raised
    extra: dict[str, list[Any]]  # other keys of dict returns, one entry per sample (None where absent)
    errors: list[SampleError] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


# ---- scoring one chunk (runs in the caller, a thread or a worker process) ----

def _score_one(fn: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> tuple:
    """("ok", score, extras, was_dict) | ("error", message, traceback) | ("bad_return", description)."""
    try:
        value = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
    except Exception as exc:
        return _error(exc)
    return _check_value(value)


def _error(exc: BaseException) -> tuple:
    return ("error", f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))


def _check_value(value: Any) -> tuple:
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


def _score_chunk(fn: Callable[..., Any], chunk: list[tuple[str, str, Any, Any]]) -> list[tuple]:
    if not getattr(fn, "is_async", False) and not inspect.iscoroutinefunction(fn):
        return [_score_one(fn, *sample) for sample in chunk]

    async def one(sample: tuple) -> tuple:
        data_source, solution_str, ground_truth, extra_info = sample
        try:
            value = await fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                             extra_info=extra_info)
        except Exception as exc:
            return _error(exc)
        return _check_value(value)

    async def every() -> list[tuple]:
        return list(await asyncio.gather(*(one(sample) for sample in chunk)))

    return asyncio.run(every())


def _score_batch(fn: Any, samples: list[tuple]) -> list[tuple]:
    """One call for the batch (batch-form functions); its result checked element by element."""
    columns = [list(column) for column in zip(*samples)] if samples else [[], [], [], []]
    try:
        result = fn.score_batch(*columns)
        if inspect.isawaitable(result):
            async def wait() -> Any:
                return await result

            result = asyncio.run(wait())
    except Exception as exc:
        return [_error(exc)] * len(samples)
    if hasattr(result, "tolist") and not isinstance(result, (list, tuple)):
        result = result.tolist()  # numpy arrays, tensors
    if not isinstance(result, (list, tuple)) or len(result) != len(samples):
        what = f"{len(result)} values" if isinstance(result, (list, tuple)) else f"a {type(result).__name__}"
        return [("bad_return", f"{what} for a batch of {len(samples)} responses (a batch reward function returns "
                               "a list with one score or dict per response)")] * len(samples)
    return [_check_value(value) for value in result]


# ---- the manager ----

class RewardManager:
    """Scores batches of decoded responses with a verl-style ``compute_score`` function."""

    def __init__(self, compute_score: Callable[..., Any] | None = None, *, num_workers: int = 1,
                 executor: str = "process", on_error: str = "zero", kind: str = "naive",
                 overlong: OverlongPenalty | None = None):
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"reward.on_error={on_error!r} is not one of {ON_ERROR_MODES}")
        if executor not in EXECUTORS:
            raise ValueError(f"reward.executor={executor!r} is not one of {EXECUTORS}")
        if int(num_workers) < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {num_workers}")
        self.compute_score = compute_score or default_compute_score
        self.form = form_of(self.compute_score)
        if kind == "batch" and self.form == SAMPLE:
            raise ValueError("reward_model.reward_manager=batch calls the reward function once per batch, but it has "
                             "the per-sample form; give a batch-form function (megarl.rewards.custom) or use naive")
        if self.form != SAMPLE and int(num_workers) > 1:
            raise ValueError(f"reward.num_workers={num_workers}: a batch-form reward function is called once per batch "
                             "in the controller; set reward.num_workers=1")
        if overlong is not None and kind != "dapo":
            raise ValueError("the overlong penalty is applied by the dapo reward manager (reward_model.reward_manager=dapo)")
        self.kind = kind
        self.overlong = overlong
        self.num_workers = int(num_workers)
        self.executor = executor
        self.on_error = on_error
        self._pool: futures.Executor | None = None
        if self.num_workers > 1 and executor == "process":
            try:
                pickle.dumps(self.compute_score)
            except Exception as exc:
                raise ValueError(
                    f"reward function {self.compute_score!r} cannot be sent to worker processes ({exc}); define it at "
                    "module level, load it with custom_reward_function.path, or set reward.executor=thread"
                ) from exc

    @classmethod
    def from_config(cls, cfg: Any) -> "RewardManager":
        """From the top-level config (``custom_reward_function``, ``reward`` and ``reward_model`` sections)."""
        reward_cfg = _get(cfg, "reward")
        return cls(
            load_reward_function(_get(cfg, "custom_reward_function"), function_kwargs(cfg)),
            num_workers=int(_get(reward_cfg, "num_workers", 1)),
            executor=str(_get(reward_cfg, "executor", "process")),
            on_error=str(_get(reward_cfg, "on_error", "zero")),
            kind=manager_name(cfg),
            overlong=overlong_penalty(cfg),
        )

    def score_samples(self, samples: Sequence[dict[str, Any]]) -> RewardResult:
        """Score dicts with keys data_source, solution_str (or response), ground_truth, extra_info (optional)."""
        columns: dict[str, list[Any]] = {"data_source": [], "solution_str": [], "ground_truth": [], "extra_info": []}
        for i, sample in enumerate(samples):
            text = sample.get("solution_str", sample.get("response"))
            missing = [k for k, v in (("data_source", sample.get("data_source")), ("solution_str", text),
                                      ("ground_truth", sample.get("ground_truth"))) if v is None]
            if missing:
                raise KeyError(f"reward sample {i} lacks {missing}; keys present: {sorted(sample)}")
            columns["data_source"].append(sample["data_source"])
            columns["solution_str"].append(text)
            columns["ground_truth"].append(sample["ground_truth"])
            columns["extra_info"].append(sample.get("extra_info"))
        return self.score(columns["data_source"], columns["solution_str"], columns["ground_truth"], columns["extra_info"])

    def score(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[Any] | None = None, response_lengths: Sequence[int] | None = None) -> RewardResult:
        """Score parallel lists (one entry per response); ``response_lengths`` (tokens) for the overlong penalty."""
        n = len(solution_strs)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"reward inputs differ in length: data_sources={len(data_sources)}, solution_strs={n}, "
                f"ground_truths={len(ground_truths)}, extra_infos={len(extra_infos)}"
            )
        if self.overlong is not None and (response_lengths is None or len(response_lengths) != n):
            raise ValueError("the overlong penalty needs the response length (in tokens) of every response")
        samples = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
        outcomes = self._run(samples)
        return self._collect(samples, outcomes, response_lengths)

    def _run(self, samples: list[tuple]) -> list[tuple]:
        if self.form != SAMPLE:
            return _score_batch(self.compute_score, samples)
        if self.num_workers == 1 or len(samples) <= 1:
            return _score_chunk(self.compute_score, samples)
        pool = self._get_pool()
        chunk_size = max(1, -(-len(samples) // (self.num_workers * 4)))
        chunks = [samples[i:i + chunk_size] for i in range(0, len(samples), chunk_size)]
        try:
            results = list(pool.map(_score_chunk, [self.compute_score] * len(chunks), chunks))
        except futures.process.BrokenProcessPool as exc:
            self._pool = None
            raise RewardFunctionError(
                "a reward worker process died. With reward.executor=process the entry script needs an "
                "`if __name__ == '__main__':` guard (workers are spawned), and the reward function must not "
                "crash the interpreter; set reward.num_workers=1 to see the error in this process"
            ) from exc
        return [outcome for chunk in results for outcome in chunk]

    def _get_pool(self) -> futures.Executor:
        if self._pool is None:
            if self.executor == "thread":
                self._pool = futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix="reward")
            else:
                # spawn: safe next to threads (Ray, torch) in the parent, unlike fork
                self._pool = futures.ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _collect(self, samples: list[tuple], outcomes: list[tuple], response_lengths: Sequence[int] | None = None) -> RewardResult:
        scores: list[float] = []
        extras: list[dict[str, Any]] = []
        errors: list[SampleError] = []
        for i, ((data_source, *_), outcome) in enumerate(zip(samples, outcomes)):
            kind = outcome[0]
            if kind == "bad_return":
                raise RewardFunctionError(
                    f"reward function {self.compute_score!r} returned {outcome[1]} for sample {i} "
                    f"(data_source={data_source!r}); it must return a finite number or a dict with a 'score' number"
                )
            if kind == "error":
                if self.on_error == "raise":
                    raise RewardFunctionError(
                        f"reward function raised on sample {i} (data_source={data_source!r}): {outcome[1]}\n{outcome[2]}"
                    )
                errors.append(SampleError(i, data_source, outcome[1], outcome[2]))
                scores.append(0.0)
                extras.append({})
            else:
                score, extra, was_dict = outcome[1], dict(outcome[2]), outcome[3]
                if self.kind == "dapo":  # verl's DAPO manager: a plain score is also the accuracy
                    if not was_dict:
                        extra["acc"] = score
                    if self.overlong is not None:
                        penalty = self.overlong(int(response_lengths[i]))
                        score += penalty
                        if self.overlong.log:
                            extra.update(overlong_reward=penalty, overlong=penalty < 0)
                scores.append(score)
                extras.append(extra)

        keys = sorted({k for e in extras for k in e})
        extra = {k: [e.get(k) for e in extras] for k in keys}
        metrics: dict[str, Any] = {"reward/num_errors": len(errors)}
        if scores:
            metrics["reward/score/mean"] = sum(scores) / len(scores)
        for key, values in extra.items():
            numeric = [float(v) for v in values if isinstance(v, numbers.Real)]
            if numeric:
                metrics[f"reward/{key}/mean"] = sum(numeric) / len(numeric)
        if errors:
            first = errors[0]
            metrics["reward/first_error"] = f"sample {first.index} ({first.data_source}): {first.error}"
            logger.error("reward function raised on %d of %d samples (scored 0); first, sample %d:\n%s",
                         len(errors), len(samples), first.index, first.traceback)
        return RewardResult(scores=scores, extra=extra, errors=errors, metrics=metrics)

    def close(self) -> None:
        """Stop the worker pool, if one was started."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
