"""Reward functions given by file path (verl's ``custom_reward_function`` section).

Config keys: ``custom_reward_function.path`` (a ``.py`` file; unset = the built-in
rule rewards), ``.name`` (default ``compute_score``) and ``.reward_kwargs`` (extra
keyword arguments passed on every call). The function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

and returns a number, or a dict with a ``"score"`` number whose other keys are
reported as extra metrics.

:class:`RewardFunction` can be pickled: a worker process receiving one loads the
file itself, once, so parallel scoring works with functions from any file.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from megarl.rewards.registry import default_compute_score

DEFAULT_FUNCTION_NAME = "compute_score"

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


def _check_signature(fn: Callable[..., Any], where: str, kwargs: dict[str, Any]) -> None:
    """Fail at load time, not at the first batch, if the function cannot take verl's arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: the first call will tell
    try:
        signature.bind(data_source="", solution_str="", ground_truth="", extra_info=None, **kwargs)
    except TypeError as exc:
        raise RewardFunctionLoadError(
            f"{where} must accept (data_source, solution_str, ground_truth, extra_info=None"
            f"{', ' + ', '.join(kwargs) if kwargs else ''}) as keyword arguments: {exc}"
        ) from exc


class RewardFunction:
    """A custom reward function loaded from a file; callable with verl's signature; picklable."""

    def __init__(self, path: str, name: str = DEFAULT_FUNCTION_NAME, reward_kwargs: dict[str, Any] | None = None):
        self.path = os.path.abspath(os.path.expanduser(str(path)))
        self.name = name or DEFAULT_FUNCTION_NAME
        self.reward_kwargs = dict(reward_kwargs or {})
        self._fn = _load_function(self.path, self.name)
        _check_signature(self._fn, f"custom reward function {self.name!r} in {self.path!r}", self.reward_kwargs)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return self._fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                        extra_info=extra_info, **self.reward_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fn = _load_function(self.path, self.name)

    def __repr__(self) -> str:
        return f"RewardFunction(path={self.path!r}, name={self.name!r}, reward_kwargs={self.reward_kwargs!r})"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def load_reward_function(custom_cfg: Any = None) -> Callable[..., Any]:
    """The scoring function for a ``custom_reward_function`` config section.

    With ``path`` set: that file's function. Without: the built-in rule rewards
    (:func:`default_compute_score`), with ``reward_kwargs`` bound if given.
    """
    path = _get(custom_cfg, "path")
    name = _get(custom_cfg, "name", DEFAULT_FUNCTION_NAME)
    reward_kwargs = dict(_get(custom_cfg, "reward_kwargs", {}))
    if path:
        return RewardFunction(str(path), str(name), reward_kwargs)
    if reward_kwargs:
        return functools.partial(default_compute_score, **reward_kwargs)
    return default_compute_score
