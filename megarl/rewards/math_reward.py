r"""Rule rewards for competition math.

- :func:`compute_score` (MATH: ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
  ``HuggingFaceH4/MATH-500``): the answer is the last ``\boxed{...}`` of the
  response; 1.0 if it matches the ground truth, else 0.0 (verl's convention).
- :func:`compute_dapo_score` (``math_dapo``, ``aime*``): DAPO's format, where the
  last line reads "Answer: ..."; a ``\boxed{}`` answer is accepted too unless
  ``strict_box_verify`` asks for ``\boxed{}`` only. Like verl's ``math_dapo`` it
  returns ``{"score": 1.0 or -1.0, "acc": 1.0 or 0.0, "pred": str}``.
"""
from __future__ import annotations

import re

from megarl.rewards.math_answer import answers_match, last_boxed_content

_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


def compute_score(solution_str: str, ground_truth: str) -> float:
    predicted = last_boxed_content(solution_str)
    return 1.0 if answers_match(predicted, str(ground_truth)) else 0.0


def extract_dapo_answer(solution_str: str, strict_box_verify: bool = False) -> str | None:
    r"""The final answer in DAPO's format ("Answer: ..." on the last such line) or a ``\boxed{}``."""
    boxed = last_boxed_content(solution_str)
    if strict_box_verify:
        return boxed
    lines = _ANSWER_LINE.findall(solution_str)
    if lines:
        answer = lines[-1].strip()
        return last_boxed_content(answer) or answer
    return boxed


def compute_dapo_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> dict[str, float | str]:
    predicted = extract_dapo_answer(solution_str, strict_box_verify=strict_box_verify)
    correct = answers_match(predicted, str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0, "pred": predicted or ""}
