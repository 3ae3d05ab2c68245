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

With a reward model or LLM judge (``model_reward``, a ``megarl.rewards.reward_models.RewardModelService``)
the pass runs while its engines are awake. A discriminative reward model's scores are the rewards
when there is no custom function; a custom function receives them (``rm_score``) and the model's
handles (``reward_router_address``, ``reward_model_tokenizer``, ``judge``) by name. A call that
raises ``JudgeError`` (the judge failed after its retries, or the answer could not be parsed) or
runs past ``reward_model.timeout`` (``rate_limited`` manager) scores ``reward_model.judge.fallback_score``,
counted as ``reward/judge_failures`` (``reward/timeouts``), never an error that stops the run.

The ``rate_limited`` manager (verl's; ``limited`` is accepted too) runs a batch's calls
concurrently in the controller within ``reward_model.max_concurrent``, ``max_rpm``, ``max_tpm``
and ``timeout`` (:mod:`megarl.rewards.rate_limit`); sync functions run in a thread pool.

Config keys read by :meth:`RewardManager.from_config`: ``custom_reward_function.*``
(see :mod:`megarl.rewards.custom`), ``reward.num_workers`` [1], ``reward.executor``
["process"], ``reward.on_error`` ["zero"], ``reward_model.reward_manager`` ["naive"] and the
dapo manager's ``reward_kwargs`` (see :mod:`megarl.rewards.manager_keys`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as futures
import contextlib
import functools
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
from megarl.rewards.manager_keys import OverlongPenalty, canonical_manager, function_kwargs, manager_name, overlong_penalty
from megarl.rewards.reward_models.judge import JudgeError
from megarl.rewards.rate_limit import CallTimedOut, LimitSettings, RateLimits
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
# A sample is (data_source, solution_str, ground_truth, extra_info, context): ``context`` holds the
# reward-model arguments the function takes. An outcome is ("ok", score, extras, was_dict) |
# ("error", message, traceback) | ("judge", message, timed_out) | ("bad_return", description).

def _score_one(fn: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any, extra_info: Any,
               context: dict[str, Any]) -> tuple:
    try:
        value = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info,
                   **context)
    except Exception as exc:
        return _error(exc)
    return _check_value(value)


def _error(exc: BaseException) -> tuple:
    if isinstance(exc, (JudgeError, CallTimedOut)):
        return ("judge", f"{type(exc).__name__}: {exc}", isinstance(exc, CallTimedOut))
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


def _score_chunk(fn: Callable[..., Any], chunk: list[tuple]) -> list[tuple]:
    if not getattr(fn, "is_async", False) and not inspect.iscoroutinefunction(fn):
        return [_score_one(fn, *sample) for sample in chunk]

    async def one(sample: tuple) -> tuple:
        data_source, solution_str, ground_truth, extra_info, context = sample
        try:
            value = await fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                             extra_info=extra_info, **context)
        except Exception as exc:
            return _error(exc)
        return _check_value(value)

    async def every() -> list[tuple]:
        return list(await asyncio.gather(*(one(sample) for sample in chunk)))

    return asyncio.run(every())


def _score_limited(fn: Callable[..., Any], samples: list[tuple], limits: LimitSettings) -> list[tuple]:
    """The ``rate_limited`` manager: every call of the batch at once, within the limits."""
    asynchronous = getattr(fn, "is_async", False) or inspect.iscoroutinefunction(fn)

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
                return _error(exc)
            return _check_value(value)

        try:
            return list(await asyncio.gather(*(one(sample) for sample in samples)))
        finally:
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)  # a call past its time limit keeps its thread

    return asyncio.run(every())


def _score_batch(fn: Any, samples: list[tuple], context: dict[str, Any]) -> list[tuple]:
    """One call for the batch (batch-form functions); its result checked element by element."""
    columns = [list(column) for column in zip(*samples)][:4] if samples else [[], [], [], []]
    try:
        result = fn.score_batch(*columns, **context)
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
                 overlong: OverlongPenalty | None = None, model_reward: Any = None,
                 limits: LimitSettings | None = None, fallback_score: float = 0.0):
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
        kind = canonical_manager(kind)
        if kind == "rate_limited" and int(num_workers) > 1:
            raise ValueError(f"reward.num_workers={num_workers}: the rate_limited manager runs its calls concurrently in "
                             "the controller (reward_model.max_concurrent); set reward.num_workers=1")
        self.model_reward = model_reward
        self.custom = compute_score is not None and compute_score is not default_compute_score \
            and not isinstance(compute_score, functools.partial)
        self.context_names = frozenset(getattr(self.compute_score, "context", ())) if model_reward is not None else frozenset()
        self.limits = limits or LimitSettings()
        self.fallback_score = float(fallback_score)
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
    def from_config(cls, cfg: Any, model_reward: Any = None) -> "RewardManager":
        """From the top-level config (``custom_reward_function``, ``reward`` and ``reward_model``
        sections); ``model_reward`` is the run's reward model or judge, if it has one."""
        reward_cfg, rm = _get(cfg, "reward"), _get(cfg, "reward_model")
        return cls(
            load_reward_function(_get(cfg, "custom_reward_function"), function_kwargs(cfg)),
            num_workers=int(_get(reward_cfg, "num_workers", 1)),
            executor=str(_get(reward_cfg, "executor", "process")),
            on_error=str(_get(reward_cfg, "on_error", "zero")),
            kind=manager_name(cfg),
            overlong=overlong_penalty(cfg),
            model_reward=model_reward,
            limits=LimitSettings.from_config(rm) if rm is not None and "max_concurrent" in rm else None,
            fallback_score=float(rm.judge.fallback_score) if rm is not None and "judge" in rm else 0.0,
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
              extra_infos: Sequence[Any] | None = None, response_lengths: Sequence[int] | None = None,
              model_inputs: Any = None) -> RewardResult:
        """Score parallel lists (one entry per response); ``response_lengths`` (tokens) for the overlong
        penalty; ``model_inputs`` (``megarl.rewards.reward_models.ResponsesToScore``) for a reward model."""
        n = len(solution_strs)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"reward inputs differ in length: data_sources={len(data_sources)}, solution_strs={n}, "
                f"ground_truths={len(ground_truths)}, extra_infos={len(extra_infos)}"
            )
        if self.overlong is not None and (response_lengths is None or len(response_lengths) != n):
            raise ValueError("the overlong penalty needs the response length (in tokens) of every response")
        model = self.model_reward
        with model.awake() if model is not None else contextlib.nullcontext():
            rm = None
            if model is not None and model.scores_responses and (not self.custom or self.context_names & {"rm_score", "rm_scores"}):
                if model_inputs is None or len(model_inputs) != n:
                    raise ValueError("a reward model needs the prompts and responses it scores (model_inputs)")
                rm = model.score(model_inputs)
            context = model.context(self.context_names) if model is not None else {}
            samples = [(d, s, g, e, {**context, **({"rm_score": rm.scores[i]} if "rm_score" in self.context_names else {})})
                       for i, (d, s, g, e) in enumerate(zip(data_sources, solution_strs, ground_truths, extra_infos))]
            if rm is not None and not self.custom:  # the reward model's score is the reward
                outcomes = [("ok", float(v), {}, False) for v in rm.scores]
            else:
                if "rm_scores" in self.context_names:
                    context = {**context, "rm_scores": list(rm.scores)}
                outcomes = self._run(samples, context)
        result = self._collect(samples, outcomes, response_lengths)
        if rm is not None:
            result.metrics.update(rm.metrics)
        if model is not None:
            result.metrics.update(model.client_metrics())
        return result

    def _run(self, samples: list[tuple], batch_context: dict[str, Any]) -> list[tuple]:
        if self.form != SAMPLE:
            return _score_batch(self.compute_score, samples, batch_context)
        if self.kind == "rate_limited":
            return _score_limited(self.compute_score, samples, self.limits)
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
        judge_failures: list[str] = []
        timeouts = 0
        for i, ((data_source, *_), outcome) in enumerate(zip(samples, outcomes)):
            kind = outcome[0]
            if kind == "judge":  # the judge failed or a call ran out of time: the fallback, counted
                judge_failures.append(f"sample {i} ({data_source}): {outcome[1]}")
                timeouts += bool(outcome[2])
                outcome = ("ok", self.fallback_score, {}, False)
                kind = "ok"
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
        if (self.model_reward is not None and not self.model_reward.scores_responses) or self.kind == "rate_limited":
            metrics.update({"reward/judge_failures": len(judge_failures), "reward/timeouts": timeouts})
        if judge_failures:
            logger.warning("the judge failed on %d of %d samples (scored %g, reward_model.judge.fallback_score); "
                           "first: %s", len(judge_failures), len(samples), self.fallback_score, judge_failures[0])
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
