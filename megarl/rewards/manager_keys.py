"""verl's reward managers (``reward_model.reward_manager``, or ``reward.reward_manager.name``).

* ``naive`` (default): the reward function's score;
* ``dapo``: the score plus DAPO's soft overlong penalty (arXiv:2503.14476) when it is enabled,
  and the score recorded as ``acc`` when the function returns a number (verl's DAPO manager);
* ``batch``: the function is called once per batch; it must have one of the batch forms
  (``megarl.rewards.custom``). A batch-form function is called that way under any manager;
* ``rate_limited`` (verl's name; ``limited``, the name of verl's module, is accepted too): the
  calls of a batch run concurrently within ``reward_model.max_concurrent``, ``max_rpm``,
  ``max_tpm`` and ``timeout`` (``megarl.rewards.rate_limit``), for judges and APIs with quotas.

The manager's keyword arguments are ``reward_model.reward_kwargs`` (verl's place; 2026:
``reward.reward_kwargs``): every manager takes ``compute_score_timeout`` (verl's naive manager's;
read as ``reward.compute_score_timeout``, ``compute_score_timeout``), ``dapo`` also ``max_resp_len`` and ``overlong_buffer_cfg``
(``enable``, ``len``, ``penalty_factor``, ``log``); ``batch`` passes them on to the reward
function, as verl's batch manager does; ``naive`` takes none. The DAPO recipe's older
place, ``reward_model.overlong_buffer.*`` with ``max_resp_len = data.max_response_length``,
means the same. The penalty for a response of ``L`` tokens, with ``expected = max_resp_len - len``:
``min(-(L - expected) / len * penalty_factor, 0)``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megarl.config.errors import Problem, refusal

REWARD_MANAGERS = ("naive", "dapo", "batch", "rate_limited")
MANAGER_ALIASES = {"limited": "rate_limited"}
VERL_ONLY_MANAGERS = ("prime", "remote", "gdpo")  # verl registers these too
DAPO_KWARGS = ("max_resp_len", "overlong_buffer_cfg")
TIMEOUT_KWARG = "compute_score_timeout"  # verl's naive manager takes it; megarl's key is reward.compute_score_timeout
OVERLONG_KEYS = ("enable", "len", "penalty_factor", "log")


@dataclass(frozen=True)
class OverlongPenalty:
    buffer_len: int
    penalty_factor: float
    max_resp_len: int
    log: bool  # also report reward/overlong_reward and reward/overlong per sample

    def __call__(self, response_length: int) -> float:
        expected = self.max_resp_len - self.buffer_len
        return min(-(response_length - expected) / self.buffer_len * self.penalty_factor, 0.0)


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _section(cfg: Any, key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def manager_name(cfg: Any) -> str:
    section = _section(cfg, "reward_model")
    return str((section.get("reward_manager") if section is not None else None) or "naive")


def canonical_manager(name: str) -> str:
    """The registry name of a manager (``limited`` -> ``rate_limited``)."""
    return MANAGER_ALIASES.get(name, name)


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
    return {k: v for k, v in (_plain(section.get("reward_kwargs")) or {}).items() if k != TIMEOUT_KWARG}


def compute_score_timeout(cfg: Any) -> float | None:
    """The per-call time limit of the reward function in seconds (None: none): ``reward.compute_score_timeout``,
    or verl's spelling ``reward_model.reward_kwargs.compute_score_timeout`` (``reward_manager_problems``
    refuses the two with different values)."""
    section, reward = _section(cfg, "reward_model"), _section(cfg, "reward")
    kwargs = dict(_plain(section.get("reward_kwargs")) or {}) if section is not None else {}
    value = kwargs.get(TIMEOUT_KWARG, reward.get("compute_score_timeout") if reward is not None else None)
    return float(value) if value else None


def reward_manager_problems(cfg: Any) -> list[Problem]:
    """The reward manager's name and keyword arguments, and the overlong penalty's settings."""
    from megarl.rewards.rate_limit import LimitSettings

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
        problems += [Problem(message) for message in LimitSettings.from_config(cfg.reward_model).problems()]
        if cfg.reward.num_workers > 1:
            problems.append(Problem(f"reward.num_workers={cfg.reward.num_workers}: the rate_limited manager runs "
                                    "its calls concurrently in the controller (reward_model.max_concurrent); set "
                                    "reward.num_workers=1"))
    kwargs = dict(_plain(cfg.reward_model.reward_kwargs) or {})
    problems += _timeout_problems(cfg, kwargs.pop(TIMEOUT_KWARG, None))
    if name == "batch":
        given = dict(_plain(cfg.custom_reward_function.reward_kwargs) or {})
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
