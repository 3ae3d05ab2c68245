"""The rewards the config asks for: the reward manager's settings, the reward function, its limits.

Config keys read: ``custom_reward_function.*`` (``megarl.rewards.custom``), ``reward.num_workers``
[1], ``reward.executor`` ["process"], ``reward.on_error`` ["zero"], ``reward.compute_score_timeout``
[30] (or verl's ``reward_model.reward_kwargs.compute_score_timeout``), ``reward_model.reward_manager``
["naive"], its ``reward_kwargs`` (the dapo manager's overlong penalty, the batch manager's function
kwargs), the DAPO recipe's ``reward_model.overlong_buffer.*``, the rate-limited manager's
``reward_model.{max_concurrent, max_rpm, max_tpm, estimated_tokens_per_request, timeout}`` and the
judge's ``reward_model.judge.fallback_score``. ``reward_manager_problems`` is what the config check reports.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import functools
from typing import Callable

from megarl.settings import plain
from megarl.config.errors import Problem, refusal
from megarl.rewards.custom import DEFAULT_FUNCTION_NAME, RewardFunction
from megarl.rewards.manager import RewardManager
from megarl.rewards.rate_limit import LimitSettings
from megarl.rewards.registry import default_compute_score
from megarl.rewards.manager_keys import (DAPO_KWARGS, MANAGER_ALIASES, OVERLONG_KEYS, REWARD_MANAGERS, TIMEOUT_KWARG,
                                         VERL_ONLY_MANAGERS, OverlongPenalty, canonical_manager)


def _section(cfg: Any, key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def manager_name(cfg: Any) -> str:
    section = _section(cfg, "reward_model")
    return str((section.get("reward_manager") if section is not None else None) or "naive")


def overlong_penalty(cfg: Any) -> OverlongPenalty | None:
    """The DAPO overlong penalty the config enables, from either of its places (None: off)."""
    section = _section(cfg, "reward_model")
    if section is None:
        return None
    kwargs = dict(section.get("reward_kwargs") or {})
    newer = dict(kwargs.get("overlong_buffer_cfg") or {})
    older = section.get("overlong_buffer") or {}
    if newer.get("enable"):
        return OverlongPenalty(int(newer.get("len", 0)), float(newer.get("penalty_factor", 1.0)),
                               int(kwargs.get("max_resp_len") or cfg.data.max_response_length),
                               bool(newer.get("log", False)))
    if older.get("enable"):
        return OverlongPenalty(int(older.get("len", 0)), float(older.get("penalty_factor", 1.0)),
                               int(cfg.data.max_response_length), bool(older.get("log", False)))
    return None


def function_kwargs(cfg: Any) -> dict[str, Any]:
    """Keyword arguments the manager adds to every reward-function call (the batch manager's)."""
    section = _section(cfg, "reward_model")
    if manager_name(cfg) != "batch" or section is None:
        return {}
    return {k: v for k, v in (plain(section.get("reward_kwargs")) or {}).items() if k != TIMEOUT_KWARG}


def compute_score_timeout(cfg: Any) -> float | None:
    """The per-call time limit of the reward function in seconds (None: none): ``reward.compute_score_timeout``,
    or verl's spelling ``reward_model.reward_kwargs.compute_score_timeout`` (``reward_manager_problems``
    refuses the two with different values)."""
    section, reward = _section(cfg, "reward_model"), _section(cfg, "reward")
    kwargs = dict(plain(section.get("reward_kwargs")) or {}) if section is not None else {}
    value = kwargs.get(TIMEOUT_KWARG, reward.get("compute_score_timeout") if reward is not None else None)
    return float(value) if value else None


def reward_manager_problems(cfg: Any) -> list[Problem]:
    """The reward manager's name and keyword arguments, and the overlong penalty's settings."""

    problems: list[Problem] = []
    name = canonical_manager(manager_name(cfg))
    key = "reward_model.reward_manager"
    if name in VERL_ONLY_MANAGERS:
        problems.append(refusal(f"{key}={name}", f"verl's {name!r} reward manager",
                                f"megarl's reward managers are {', '.join(REWARD_MANAGERS)}"))
    elif name not in REWARD_MANAGERS:
        problems.append(Problem(f"{key}={name!r}: megarl's reward managers are {', '.join(REWARD_MANAGERS)} "
                                f"(and {', '.join(MANAGER_ALIASES)})", key=key))
    if name == "rate_limited":
        problems += [Problem(message) for message in limit_settings(cfg.reward_model).problems()]
        if cfg.reward.num_workers > 1:
            problems.append(Problem(f"reward.num_workers={cfg.reward.num_workers}: the rate_limited manager runs "
                                    "its calls concurrently in the controller (reward_model.max_concurrent); set "
                                    "reward.num_workers=1"))
    kwargs = dict(plain(cfg.reward_model.reward_kwargs) or {})
    problems += _timeout_problems(cfg, kwargs.pop(TIMEOUT_KWARG, None))
    if name == "batch":
        given = dict(plain(cfg.custom_reward_function.reward_kwargs) or {})
        for key in sorted(set(given) & set(kwargs)):
            if given[key] != kwargs[key]:
                problems.append(Problem(f"custom_reward_function.reward_kwargs.{key}={given[key]} and "
                                        f"reward_model.reward_kwargs.{key}={kwargs[key]} both go to the reward "
                                        "function (batch manager); give one"))
        return problems
    allowed = DAPO_KWARGS if name == "dapo" else ()
    for extra in sorted(set(kwargs) - set(allowed)):
        takes = f"takes {', '.join(allowed)}" if allowed else "takes no keyword arguments"
        problems.append(Problem(f"reward_model.reward_kwargs.{extra}: the {name} reward manager {takes} "
                                "(the overlong penalty needs reward_manager=dapo)", key=f"reward_model.reward_kwargs.{extra}"))
    newer = kwargs.get("overlong_buffer_cfg")
    if newer is not None and not isinstance(newer, Mapping):
        problems.append(Problem("reward_model.reward_kwargs.overlong_buffer_cfg must be a mapping of "
                                f"{', '.join(OVERLONG_KEYS)}"))
        return problems
    for extra in sorted(set(newer or {}) - set(OVERLONG_KEYS)):
        problems.append(Problem(f"reward_model.reward_kwargs.overlong_buffer_cfg.{extra}: unknown; the keys are "
                                f"{', '.join(OVERLONG_KEYS)}"))
    both = bool((newer or {}).get("enable")) and bool(cfg.reward_model.overlong_buffer.enable)
    if both:
        problems.append(Problem("reward_model.reward_kwargs.overlong_buffer_cfg.enable and "
                                "reward_model.overlong_buffer.enable both turn on the overlong penalty; keep one "
                                "(reward_kwargs.overlong_buffer_cfg is verl's current place)"))
        return problems
    penalty = None
    try:
        penalty = overlong_penalty(cfg)
    except (TypeError, ValueError) as exc:
        problems.append(Problem(f"the overlong penalty's settings are not numbers: {exc}"))
    if penalty is not None:
        where = "reward_model.reward_kwargs.overlong_buffer_cfg" if (newer or {}).get("enable") else "reward_model.overlong_buffer"
        if name != "dapo" and where == "reward_model.overlong_buffer":  # the newer place is reported above
            problems.append(Problem(f"{where}.enable=True: the overlong penalty is applied by the dapo reward "
                                    f"manager; set reward_model.reward_manager=dapo (now {name!r})"))
        if penalty.buffer_len < 1:
            problems.append(Problem(f"{where}.len={penalty.buffer_len}: must be >= 1 token when the penalty is on"))
        elif penalty.buffer_len > penalty.max_resp_len:
            problems.append(Problem(f"{where}.len={penalty.buffer_len} exceeds the max response length "
                                    f"{penalty.max_resp_len} (max_resp_len / data.max_response_length)"))
    return problems


def _timeout_problems(cfg: Any, verl_value: Any) -> list[Problem]:
    """``reward.compute_score_timeout`` and verl's ``reward_kwargs.compute_score_timeout``: seconds >= 0 (or
    null); the verl spelling is read as the key, so the two set to different values is an error."""
    from megarl.config.schema import RewardConfig

    key, value = "reward.compute_score_timeout", cfg.reward.compute_score_timeout
    verl_key = f"reward_model.reward_kwargs.{TIMEOUT_KWARG}"
    problems = []
    for where, given in ((key, value), (verl_key, verl_value)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, (int, float)) or not given >= 0):
            problems.append(Problem(f"{where}={given!r}: give the seconds a reward-function call may take (0 or null: "
                                    "no limit)", key=where))
    if verl_value is not None and value not in (verl_value, RewardConfig.compute_score_timeout):
        problems.append(Problem(f"{key}={value} and {verl_key}={verl_value} (verl's spelling of the same limit) "
                                "differ; give one", key=key))
    return problems


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def load_reward_function(custom_cfg: Any = None, manager_kwargs: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The scoring function for a ``custom_reward_function`` config section.

    With ``path`` set: that file's function (a ``RewardFunction``). Without: the built-in rule
    rewards (:func:`default_compute_score`), with ``reward_kwargs`` bound if given.
    ``manager_kwargs`` are added to ``reward_kwargs`` (the batch manager's, see ``managers``).
    """
    path = _get(custom_cfg, "path")
    name = _get(custom_cfg, "name", DEFAULT_FUNCTION_NAME)
    reward_kwargs = {**dict(_get(custom_cfg, "reward_kwargs", {})), **dict(manager_kwargs or {})}
    if path:
        return RewardFunction(str(path), str(name), reward_kwargs)
    if reward_kwargs:
        return functools.partial(default_compute_score, **reward_kwargs)
    return default_compute_score


def limit_settings(rm: Any) -> LimitSettings:
    """The rate-limited manager's limits from the ``reward_model`` section."""
    return LimitSettings(int(rm.max_concurrent), rm.max_rpm, rm.max_tpm, int(rm.estimated_tokens_per_request),
                         float(rm.timeout))


def reward_manager(cfg: Any, model_reward: Any = None) -> RewardManager:
    """The run's reward manager, from the top-level config (``custom_reward_function``, ``reward`` and
    ``reward_model`` sections); ``model_reward`` is the run's reward model or judge, if it has one."""
    reward_cfg, rm = _get(cfg, "reward"), _get(cfg, "reward_model")
    return RewardManager(
        load_reward_function(_get(cfg, "custom_reward_function"), function_kwargs(cfg)),
        num_workers=int(_get(reward_cfg, "num_workers", 1)),
        executor=str(_get(reward_cfg, "executor", "process")),
        on_error=str(_get(reward_cfg, "on_error", "zero")),
        kind=manager_name(cfg),
        overlong=overlong_penalty(cfg),
        model_reward=model_reward,
        limits=limit_settings(rm) if rm is not None and "max_concurrent" in rm else None,
        fallback_score=float(rm.judge.fallback_score) if rm is not None and "judge" in rm else 0.0,
        timeout_s=compute_score_timeout(cfg),
    )
