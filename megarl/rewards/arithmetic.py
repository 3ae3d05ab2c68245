"""Reward for the built-in arithmetic task (data_source ``megarl/arithmetic``).

The prompt asks for "just the number", so the first number in the response is
the answer: 1.0 if it equals the ground truth, else 0.0.
"""
from __future__ import annotations

from megarl.rewards.numbers import find_numbers, same_number


def compute_score(solution_str: str, ground_truth: str) -> float:
    numbers = find_numbers(solution_str)
    return 1.0 if numbers and same_number(numbers[0], ground_truth) else 0.0
