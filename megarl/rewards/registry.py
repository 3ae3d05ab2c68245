"""The built-in rule rewards, picked by ``data_source`` (verl's ``default_compute_score``).

- ``openai/gsm8k``: :mod:`megarl.rewards.gsm8k` (strict by default, as in verl);
- ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``:
  :func:`megarl.rewards.math_reward.compute_score` (last ``\\boxed{}``);
- ``math_dapo``, ``math``, ``math_dapo_reasoning`` and names starting with ``aime``:
  :func:`megarl.rewards.math_reward.compute_dapo_score`;
- ``megarl/arithmetic``: :mod:`megarl.rewards.arithmetic` (first number).

Extra keyword arguments (``custom_reward_function.reward_kwargs`` when no custom
path is set) go to the selected function, e.g. ``method="flexible"`` for GSM8K.
Other data sources need a custom reward function (``custom_reward_function.path``).
"""
from __future__ import annotations

from typing import Any, Callable

from megarl.config.registry import Registry
from megarl.rewards import arithmetic, geo3k, gsm8k, math_reward

# data_source -> its scoring function; ``prefix=True``: every data_source starting with the name.
RULE_REWARDS = Registry("rule reward", "data_source (a column of the data; else custom_reward_function.path)",
                        traits={"prefix": False})


def _gsm8k(solution_str: str, ground_truth: Any, extra_info: Any, **kwargs: Any) -> float:
    return gsm8k.compute_score(solution_str, str(ground_truth), **kwargs)


def _math(solution_str: str, ground_truth: Any, extra_info: Any, **kwargs: Any) -> float:
    return math_reward.compute_score(solution_str, str(ground_truth), **kwargs)


def _math_dapo(solution_str: str, ground_truth: Any, extra_info: Any, **kwargs: Any) -> dict[str, Any]:
    return math_reward.compute_dapo_score(solution_str, str(ground_truth), **kwargs)


def _geo3k(solution_str: str, ground_truth: Any, extra_info: Any, **kwargs: Any) -> float:
    return geo3k.compute_score(solution_str, ground_truth, **kwargs)


def _arithmetic(solution_str: str, ground_truth: Any, extra_info: Any, **kwargs: Any) -> float:
    return arithmetic.compute_score(solution_str, str(ground_truth), **kwargs)


for _name, _fn in (("openai/gsm8k", _gsm8k), ("lighteval/MATH", _math), ("DigitalLearningGmbH/MATH-lighteval", _math),
                   ("HuggingFaceH4/MATH-500", _math), ("math_dapo", _math_dapo),
                   ("math", _math_dapo), ("math_dapo_reasoning", _math_dapo),  # verl scores these with DAPO's reward too
                   ("hiyouga/geometry3k", _geo3k), ("megarl/arithmetic", _arithmetic)):
    RULE_REWARDS.register(_name)(_fn)
RULE_REWARDS.register("aime", prefix=True)(_math_dapo)

# verl's other built-in rewards, which megarl does not have (what they grade).
VERL_ONLY_REWARDS: dict[str, str] = {
    **{f"numina_{name}": "PRIME's math grader" for name in ("aops_forum", "synthetic_math", "amc_aime",
                                                            "synthetic_amc", "cn_k12", "olympiads")},
    **{name: "code execution against test cases" for name in ("codecontests", "apps", "codeforces", "taco")},
    **{f"searchR1_{name}": "search-QA exact match" for name in ("nq", "triviaqa", "popqa", "hotpotqa",
                                                               "2wikimultihopqa", "musique", "bamboogle")},
}


class UnknownDataSourceError(ValueError):
    """No built-in reward for a data_source."""


def find_rule_reward(data_source: str) -> Callable[..., Any]:
    prefixes = RULE_REWARDS.having(prefix=True)
    if data_source in RULE_REWARDS and data_source not in prefixes:
        return RULE_REWARDS[data_source]
    for prefix in sorted(prefixes):
        if data_source.startswith(prefix):
            return RULE_REWARDS[prefix]
    raise UnknownDataSourceError(
        f"no built-in reward for data_source={data_source!r}; built-in: {sorted(set(RULE_REWARDS) - prefixes)} and "
        f"names starting with {sorted(prefixes)}. Write compute_score(data_source, solution_str, ground_truth, extra_info=None) "
        "in a file and set custom_reward_function.path (and .name)"
    )


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> float | dict[str, Any]:
    """Score one response with the rule reward of its data_source (verl's signature)."""
    return find_rule_reward(data_source)(solution_str, ground_truth, extra_info, **kwargs)
