"""GSM8K rule reward (data_source ``openai/gsm8k``), with verl's parameters.

Two ways to find the model's final answer:

- ``strict`` (verl's default): the number after the last ``####``, the format the
  GSM8K prompt asks for ("output the final answer after ####").
- ``flexible``: the last number anywhere in the response.

``score`` is given for a correct answer, ``format_score`` for an answer that was
found but is wrong, and 0 when no answer was found (verl's convention). Unlike
verl's regex, numbers written "1,234", "$18" or "18." at the end of a sentence
parse, and "18.0" equals "18".
"""
from __future__ import annotations

import re

from megarl.rewards.numbers import NUMBER_PATTERN, find_numbers, same_number

METHODS = ("strict", "flexible")

# "#### 42", "####42", "#### $1,200", "#### -3"
_STRICT = re.compile(r"####\s*\$?\s*(" + NUMBER_PATTERN.pattern + ")")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as written in the response (commas kept), or None if there is none."""
    if method not in METHODS:
        raise ValueError(f"GSM8K method must be one of {METHODS}, got {method!r}")
    if method == "strict":
        matches = _STRICT.findall(solution_str)
    else:
        matches = find_numbers(solution_str)
    return matches[-1] if matches else None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if wrong, 0 if none."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if same_number(answer, ground_truth) else float(format_score)
