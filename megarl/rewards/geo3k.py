"""Geometry3K rule reward (data_source ``hiyouga/geometry3k``), as verl scores it.

verl's multimodal example (Qwen2.5-VL / Qwen3-VL GRPO on geometry problems drawn as images) asks the
model to reason inside ``<think>...</think>`` and to put its final answer in ``\\boxed{}``. The score
is ``(1 - format_score) * accuracy + format_score * format`` with verl's ``format_score=0.1``:

- accuracy: the last ``\\boxed{}``'s content graded against the ground truth by mathruler's
  ``grade_answer`` (the grader verl uses: normalised string match, then sympy equivalence, so
  ``\\frac{1}{2}`` equals ``0.5`` and ``30^\\circ`` equals ``30``);
- format: 1 when the whole response is ``<think>...</think>`` followed by text holding a ``\\boxed{}``.

mathruler does the grading because it is the library verl calls: the same response scores the same
on both, which a verl user moving a run over can check.
"""
from __future__ import annotations

import re

FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    return 1.0 if FORMAT.fullmatch(solution_str) else 0.0


def accuracy_reward(solution_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    from mathruler.grader import extract_boxed_content, grade_answer

    answer = extract_boxed_content(solution_str) if use_boxed else solution_str
    return 1.0 if grade_answer(answer, str(ground_truth)) else 0.0


def compute_score(solution_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    if not 0.0 <= format_score <= 1.0:
        raise ValueError(f"geo3k format_score must be within [0, 1], got {format_score}")
    return ((1.0 - format_score) * accuracy_reward(solution_str, ground_truth, use_boxed)
            + format_score * format_reward(solution_str))
