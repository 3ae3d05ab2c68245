r"""The constant-reward hint asks the run's own reward function what it accepts."""
from __future__ import annotations

import re

from megarl.rewards import RewardManager
from megarl.rewards.diagnose import constant_reward_hint

PROMPT = "<|user|>What is 6 + 1? Answer with just the number.<|assistant|>"


def boxed(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"\\boxed\{([^}]*)\}", solution_str)
    return 1.0 if found and found[-1] == str(ground_truth) else 0.0


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth))


def never(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0


def hint(fn, responses, prompts=(PROMPT,), finish=("stop",), source="megarl/arithmetic"):
    manager = RewardManager(fn)
    n = len(responses)
    return constant_reward_hint(lambda *cols: list(manager.score(*cols).scores), "my reward", 0.0, [1, 2],
                                list(prompts) * n if len(prompts) == 1 else list(prompts), list(responses),
                                ["7"] * n, [source] * n, [None] * n, list(finish) * n if len(finish) == 1 else
                                list(finish), 8)


def test_a_format_the_prompts_never_ask_for():
    text = hint(boxed, ["7", "it is 7"])
    assert text.startswith("hint: every reward of steps 1-2 is 0 (2 samples)")
    assert "  ground truth: 7 | score: 0 | reward: my reward" in text
    assert (r"  likely cause: the reward function expects \boxed{...} (it gives 1 to '\boxed{7}' but 0 to the bare "
            r"answer); no response contains '\boxed'; the prompts never ask for it") in text
    asked = hint(boxed, ["7"], prompts=(PROMPT + r" Put it in \boxed{}.",))
    assert "no response contains" in asked and "never ask" not in asked


def test_wrong_answers_truncation_and_a_reward_nothing_satisfies():
    right_format = hint(exact, ["8"])
    assert "gives 1 to the bare answer '7': the responses are wrong, not badly formatted" in right_format
    impossible = hint(never, ["", "abcdefgh"], finish=("length", "length"))
    assert r"gives 0 even to the ground truth itself, bare and as \boxed{...}, #### <answer>" in impossible
    assert "every response stopped at the length limit (8 tokens, data.max_response_length)" in impossible
    assert "1 of 2 responses are empty" in impossible


def test_under_dapos_overlong_penalty_the_cause_is_the_format_not_wrong_answers():
    """reward_manager=dapo: every response ran to the length limit, so each got boxed()'s 0 plus a penalty of -1.
    The probes (scored without that penalty, as the run's hint does) are compared with a non-answer scored the same
    way, so the hint names \\boxed{} and the penalty, not 'the responses are wrong' (the bare answer's 0 > -1)."""
    from megarl.rewards.manager_keys import OverlongPenalty

    manager = RewardManager(boxed, kind="dapo", overlong=OverlongPenalty(buffer_len=4, penalty_factor=1.0,
                                                                          max_resp_len=8, log=False))
    responses = ["7 7 7 7 7 7 7 7", "it is 7 ..."]
    assert list(manager.score(["x"] * 2, responses, ["7"] * 2, [None] * 2, [8, 8]).scores) == [-1.0, -1.0]
    text = constant_reward_hint(lambda *cols: list(manager.score(*cols, [1] * len(cols[1])).scores), "my reward", -1.0,
                                [1], [PROMPT] * 2, responses, ["7"] * 2, ["x"] * 2, [None] * 2, ["length"] * 2, 8)
    assert "the responses are wrong" not in text
    assert r"likely cause: the reward function expects \boxed{...} (it gives 1 to '\boxed{7}' but 0 to the bare" in text
    assert "a non-answer scored alone gets 0, more than the responses' -1: a penalty on the responses" in text


def test_with_a_critic_the_hint_does_not_say_the_advantages_are_zero():
    manager = RewardManager(boxed)
    args = (lambda *cols: list(manager.score(*cols).scores), "my reward", 0.0, [1], [PROMPT], ["7"], ["7"], ["x"],
            [None], ["stop"], 8)
    assert "GRPO-style advantages are all zero" in constant_reward_hint(*args)
    with_critic = constant_reward_hint(*args, critic=True)
    assert "advantages are all zero" not in with_critic
    assert "the advantages (the critic's errors) say nothing about which answer is better" in with_critic
