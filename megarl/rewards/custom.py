"""Reward functions given by file path (verl's ``custom_reward_function`` section).

Config keys: ``custom_reward_function.path`` (a ``.py`` file; unset = the built-in rule rewards),
``.name`` (default ``compute_score``) and ``.reward_kwargs`` (extra keyword arguments of every
call); verl's 2026 spelling ``reward.custom_reward_function.*`` sets the same keys. Three forms
are accepted, told apart by the function's signature when it is loaded (so before the run):

* ``sample``, verl's per-response form, called with keywords::

      def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

* ``batch``, verl's batch form (its ``batch`` reward manager), called once per batch with lists::

      def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw) -> list

* ``lists``, two positional lists (responses, then ground truths), for functions written as
  ``compute_reward(responses, ground_truths)``; it returns one score per response.

With a reward model or judge (``reward_model.enable``, ``megarl.rewards.reward_models``) a function may
also take, by name: ``reward_router_address`` (``host:port`` of the model's OpenAI-compatible
HTTP server) and ``reward_model_tokenizer`` (its tokenizer), as verl passes them (a ``**kwargs``
takes them too); ``judge`` (megarl's ``JudgeClient``); ``rm_score`` (a discriminative reward
model's score of this response; ``rm_scores``, one per response, in the batch form).

A score is a number or a dict with a ``"score"`` number (its other keys are reported as
metrics). Any form may be ``async def``: the samples of a batch are then awaited concurrently.
A signature that fits no form is refused when the function is loaded, naming the forms.

:class:`RewardFunction` can be pickled: a worker process receiving one loads the file itself,
once, so parallel scoring works with functions from any file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable


DEFAULT_FUNCTION_NAME = "compute_score"
SAMPLE, BATCH, LISTS = "sample", "batch", "lists"
FORMS = {
    SAMPLE: "compute_score(data_source, solution_str, ground_truth, extra_info=None)",
    BATCH: "compute_score(data_sources, solution_strs, ground_truths, extra_infos)",
    LISTS: "compute_reward(responses, ground_truths)",
}

# What a run with a reward model offers a reward function besides its data (see the module docstring).
VERL_CONTEXT = ("reward_router_address", "reward_model_tokenizer")  # verl's; also through **kwargs
CONTEXT = VERL_CONTEXT + ("judge", "rm_score", "rm_scores")  # megarl's only by name

_loaded_functions: dict[tuple[str, str], Callable[..., Any]] = {}


class RewardFunctionLoadError(ValueError):
    """The custom reward file or function cannot be used."""


def _load_function(path: str, name: str) -> Callable[..., Any]:
    key = (path, name)
    if key in _loaded_functions:
        return _loaded_functions[key]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom reward function file not found: {path!r} (custom_reward_function.path)")
    # A module name unique to the file, registered in sys.modules so that the
    # module's own dataclasses, pickling and relative lookups behave normally.
    module_name = "megarl_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardFunctionLoadError(f"cannot import {path!r} as a Python module: is it a .py file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RewardFunctionLoadError(f"importing custom reward file {path!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardFunctionLoadError(
            f"function {name!r} not found in {path!r} (custom_reward_function.name); callables there: {public}"
        )
    if not callable(fn):
        raise RewardFunctionLoadError(f"{name!r} in {path!r} is a {type(fn).__name__}, not a function")
    _loaded_functions[key] = fn
    return fn


def context_names(fn: Callable[..., Any]) -> frozenset[str]:
    """The reward-model arguments ``fn`` takes (``CONTEXT``): named, or verl's through ``**kwargs``."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    named = {n for n in CONTEXT if n in parameters}
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        named |= set(VERL_CONTEXT)
    return frozenset(named)


def required_context(fn: Callable[..., Any]) -> frozenset[str]:
    """The reward-model arguments ``fn`` cannot run without (named, no default)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(n for n in CONTEXT if n in parameters and parameters[n].default is inspect.Parameter.empty)


def detect_form(fn: Callable[..., Any], kwargs: dict[str, Any], where: str) -> str:
    """Which of ``FORMS`` ``fn`` takes, from its signature; a clear error if none. Reward-model
    arguments it names (``CONTEXT``) count as given."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return SAMPLE  # builtins without a signature: the first call will tell
    kwargs = {**{n: None for n in context_names(fn) if n in signature.parameters}, **kwargs}
    for form, trial in ((SAMPLE, dict(data_source="", solution_str="", ground_truth="", extra_info=None)),
                        (BATCH, dict(data_sources=[], solution_strs=[], ground_truths=[], extra_infos=[]))):
        try:
            signature.bind(**trial, **kwargs)
            return form
        except TypeError:
            pass
    try:
        signature.bind([], [], **kwargs)
        positional = [p for p in signature.parameters.values() if p.name not in kwargs
                      and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        if len(positional) == 2:
            return LISTS
    except TypeError:
        pass
    extra = f" (plus the reward_kwargs {sorted(kwargs)})" if kwargs else ""
    raise RewardFunctionLoadError(
        f"{where} has the signature {signature}, which fits none of the reward forms{extra}: "
        + "; ".join(FORMS.values()))


def is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class RewardFunction:
    """A custom reward function loaded from a file, with its form detected; picklable.

    ``form`` is ``sample`` (call it as verl's per-sample function), or ``batch`` / ``lists``
    (call ``score_batch``). ``is_async``: calls return awaitables. ``context`` holds the
    reward-model arguments it takes (``CONTEXT``); a call passes them as keywords.
    """

    def __init__(self, path: str, name: str = DEFAULT_FUNCTION_NAME, reward_kwargs: dict[str, Any] | None = None):
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.name = name or DEFAULT_FUNCTION_NAME
        self.reward_kwargs = dict(reward_kwargs or {})
        self._fn = _load_function(self.path, self.name)
        self.form = detect_form(self._fn, self.reward_kwargs, f"custom reward function {self.name!r} in {self.path!r}")
        self.is_async = is_async(self._fn)
        self.context, self.required_context = context_names(self._fn), required_context(self._fn)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                 **context: Any) -> Any:
        if self.form != SAMPLE:
            raise TypeError(f"{self!r} is a {self.form}-form function: call score_batch with lists")
        return self._fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                        extra_info=extra_info, **self.reward_kwargs, **context)

    def score_batch(self, data_sources: list, solution_strs: list, ground_truths: list, extra_infos: list,
                    **context: Any) -> Any:
        """One call for a whole batch (``batch`` and ``lists`` forms); returns the function's result."""
        if self.form == BATCH:
            return self._fn(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                            extra_infos=extra_infos, **self.reward_kwargs, **context)
        if self.form == LISTS:
            return self._fn(solution_strs, ground_truths, **self.reward_kwargs, **context)
        raise TypeError(f"{self!r} is a per-sample function: call it once per response")

    def describe(self) -> str:
        return f"{self.name} in {self.path}: {self.form} form ({FORMS[self.form]}){', async' if self.is_async else ''}"

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fn = _load_function(self.path, self.name)
        self.form = detect_form(self._fn, self.reward_kwargs, self.name)
        self.is_async = is_async(self._fn)
        self.context, self.required_context = context_names(self._fn), required_context(self._fn)

    def __repr__(self) -> str:
        return f"RewardFunction(path={self.path!r}, name={self.name!r}, reward_kwargs={self.reward_kwargs!r})"


def form_of(fn: Callable[..., Any]) -> str:
    """The form of any scoring function the manager may hold (built-ins are per-sample)."""
    return getattr(fn, "form", SAMPLE)
