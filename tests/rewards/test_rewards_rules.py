"""Rule rewards: GSM8K (strict/flexible), MATH \\boxed{}, DAPO, arithmetic, dispatch by data_source."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megarl.rewards import UnknownDataSourceError, default_compute_score, math_answer
from megarl.rewards.gsm8k import compute_score as gsm8k_score
from megarl.rewards.math_answer import last_boxed_content, normalize_answer
from megarl.rewards.math_reward import compute_dapo_score
from megarl.rewards.math_reward import compute_score as math_score

GSM8K_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"


@pytest.mark.parametrize(
    "text, truth, strict, flexible",
    [
        ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),
        ("so #### 1,234", "1234", 1.0, 1.0),
        ("#### $18", "18", 1.0, 1.0),
        ("The answer is 18.", "18", 0.0, 1.0),  # no "####": strict finds nothing
        ("#### 18.", "18", 1.0, 1.0),  # sentence-ending period
        ("#### 18.00", "18", 1.0, 1.0),
        ("#### -3", "-3", 1.0, 1.0),
        ("#### 5 then more text 6", "5", 1.0, 0.0),  # flexible takes the last number
        ("#### 12\n#### 13", "13", 1.0, 1.0),  # the last "####" counts
        ("I cannot solve this.", "4", 0.0, 0.0),
        ("She pays $1,000.50 in total", "1000.5", 0.0, 1.0),
    ],
)
def test_gsm8k_hand_examples(text, truth, strict, flexible):
    assert gsm8k_score(text, truth, method="strict") == strict
    assert gsm8k_score(text, truth, method="flexible") == flexible


def test_gsm8k_format_score_and_score():
    assert gsm8k_score("#### 5", "6", format_score=0.1, score=2.0) == 0.1  # found but wrong
    assert gsm8k_score("#### 6", "6", format_score=0.1, score=2.0) == 2.0
    assert gsm8k_score("no answer", "6", format_score=0.1, score=2.0) == 0.0  # nothing found
    with pytest.raises(ValueError, match="method"):
        gsm8k_score("#### 6", "6", method="fuzzy")


@pytest.mark.skipif(not (GSM8K_DIR / "example_model_solutions.jsonl").is_file(),
                    reason=f"{GSM8K_DIR / 'example_model_solutions.jsonl'} is absent")
def test_gsm8k_agrees_with_independent_labels():
    """Flexible GSM8K scoring vs. the human/grader is_correct labels of 4 GPT-3 variants' solutions."""
    examples = [json.loads(line) for line in (GSM8K_DIR / "example_model_solutions.jsonl").open()]
    references = [json.loads(line) for line in (GSM8K_DIR / "test.jsonl").open()]
    assert len(examples) == len(references) == 1319
    total = agree = 0
    for example, reference in zip(examples, references):
        assert example["question"] == reference["question"]
        # the ground truth as megarl.data.prepare stores it: after "####", commas removed
        ground_truth = reference["answer"].split("####")[-1].strip().replace(",", "")
        for model in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"):
            solution = example[model]
            score = default_compute_score("openai/gsm8k", solution["solution"], ground_truth, None, method="flexible")
            total += 1
            agree += (score == 1.0) == solution["is_correct"]
    agreement = agree / total
    print(f"GSM8K flexible reward vs is_correct labels: {agree}/{total} = {agreement:.4f}")
    assert total == 4 * 1319
    assert agreement >= 0.99


@pytest.mark.parametrize(
    "text, content",
    [
        (r"so \boxed{5}.", "5"),
        (r"\boxed{\frac{1}{2}} and finally \boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"$\fbox{x^{2}}$", "x^{2}"),
        (r"answer: \boxed 7$", "7"),
        (r"\boxed{unbalanced", None),
        ("no box here", None),
    ],
)
def test_last_boxed_content(text, content):
    assert last_boxed_content(text) == content


@pytest.mark.parametrize(
    "raw, normal",
    [
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        ("3/4", r"\frac{3}{4}"),
        (r"\frac12", r"\frac{1}{2}"),
        ("x = 5", "5"),
        (r"5 \text{ cm}", "5"),
        ("1,000", "1000"),
        ("5.0", "5"),
        (r"10\%", "10"),
        (r"90^\circ", "90"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\sqrt3", r"\sqrt{3}"),
        ("0.5", r"\frac{1}{2}"),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"Thus the answer is $\boxed{\dfrac{3}{4}}$.", r"\frac{3}{4}", 1.0),
        (r"\boxed{5}", "6", 0.0),
        ("The answer is 5", "5", 0.0),  # no \boxed{}: no answer
        (r"\boxed{x=2}", "2", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
    ],
)
def test_math_string_rules(response, truth, expected):
    assert math_score(response, truth) == expected


@pytest.mark.parametrize("available", [True, False])
def test_math_equivalences_need_math_verify(monkeypatch, available):
    if available and not math_answer.HAVE_MATH_VERIFY:
        pytest.skip("math-verify is not installed")
    monkeypatch.setattr(math_answer, "HAVE_MATH_VERIFY", available)
    # mathematically equal, different strings: only math-verify can tell
    assert math_score(r"\boxed{2\sqrt{3}}", r"\sqrt{12}") == (1.0 if available else 0.0)
    assert math_score(r"\boxed{\{2, 1\}}", r"\{1,2\}") == (1.0 if available else 0.0)
    assert math_score(r"\boxed{7}", "8") == 0.0


def test_dapo_answer_line_and_boxed():
    assert compute_dapo_score("work...\nAnswer: 42", "42") == {"score": 1.0, "acc": 1.0, "pred": "42"}
    assert compute_dapo_score("Answer: 41", "42")["score"] == -1.0
    assert compute_dapo_score(r"so \boxed{42}", "42")["score"] == 1.0
    assert compute_dapo_score("Answer: 42", "42", strict_box_verify=True)["score"] == -1.0
    assert default_compute_score("aime2024", "Answer: $\\frac{1}{2}$", "0.5")["acc"] == 1.0


@pytest.mark.parametrize(
    "response, truth, expected",
    [("7", "7", 1.0), ("7<|im_end|>", "7", 1.0), (" 12 is it", "12", 1.0), ("7 + 1 = 8", "8", 0.0), ("seven", "7", 0.0), ("", "7", 0.0)],
)
def test_arithmetic_first_number(response, truth, expected):
    assert default_compute_score("megarl/arithmetic", response, truth) == expected


def test_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("openai/gsm8k", "it is 3", "3") == 0.0  # strict by default, as in verl
    assert default_compute_score("lighteval/MATH", r"\boxed{3}", "3") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", r"\boxed{3}", "3") == 1.0
    with pytest.raises(UnknownDataSourceError, match=re.escape("custom_reward_function.path")):
        default_compute_score("my/unknown", "x", "y")


# Geometry3K (verl's geo3k.compute_score: 0.9 x accuracy of the last \boxed{} by mathruler + 0.1 x format)
@pytest.mark.parametrize("response, truth, score", [
    ("<think>The angles sum to 180.</think> So x = \\boxed{30}", "30", 1.0),
    ("So x = \\boxed{30}", "30", 0.9),  # right answer, no <think> block
    ("<think>guess</think> \\boxed{45}", "30", 0.1),  # the format without the answer
    ("<think>it is 30</think> 30", "30", 0.0),  # no \boxed{}: no answer, no format
    ("\\boxed{\\frac{1}{2}}", "0.5", 0.9),  # equal under sympy
    ("<think>a</think>\\boxed{2\\sqrt{3}}", "2 \\sqrt{3}", 1.0),
    ("<think>a</think>\\boxed{30^\\circ}", "30", 1.0),
])
def test_geometry3k_scores_as_verl(response, truth, score):
    assert default_compute_score("hiyouga/geometry3k", response, truth) == pytest.approx(score)


def test_geometry3k_takes_verls_parameters():
    from megarl.rewards.geo3k import compute_score as geo3k_score

    assert geo3k_score("\\boxed{30}", "30", format_score=0.0) == 1.0
    assert geo3k_score("the answer is 30", "30", use_boxed=False) == 0.0  # the whole text is not an answer
    assert geo3k_score("30", "30", use_boxed=False) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="format_score"):
        geo3k_score("x", "1", format_score=2.0)
