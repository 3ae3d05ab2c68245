r"""Why does every sample get the same (zero) reward? Ask the reward function.

When the first training steps give every sample the same reward of 0 or less, GRPO has nothing to
learn from, and the usual cause is a mismatch between what the reward function parses and what
the model writes, e.g. a reward that reads the last ``\boxed{...}`` on prompts that never ask for
one. ``constant_reward_hint`` scores the ground truth of one sample itself, bare and in the common
answer formats, with the run's own reward function (whatever it is, built-in or custom), and
says which format it rewards, whether any response contains that format and whether the prompts
ask for it; it also names truncated and empty responses. The probes are compared with a non-answer
scored the same way, not with the run's reward: a penalty on the responses themselves (DAPO's
overlong penalty) lowers the run's rewards below what any probe gets, and is named as such.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class AnswerFormat:
    name: str  # as the hint writes it
    marker: str  # text a response (or prompt) in this format contains
    wrap: Callable[[str], str]


ANSWER_FORMATS = (
    AnswerFormat(r"\boxed{...}", r"\boxed", lambda a: rf"\boxed{{{a}}}"),
    AnswerFormat("#### <answer>", "####", lambda a: f"#### {a}"),
    AnswerFormat("Answer: <answer>", "Answer:", lambda a: f"Answer: {a}"),
    AnswerFormat("<answer>...</answer>", "<answer>", lambda a: f"<answer>{a}</answer>"),
)


NON_ANSWER = "I do not know."  # scored like the probes: what the reward gives an answer that is not there


def _one_line(text: Any, limit: int = 160, tail: bool = False) -> str:
    """``text`` on one line, cut to ``limit`` characters (keeping its end with ``tail``: a templated
    prompt's question is at its end)."""
    text = str(text).replace("\n", "\\n")
    if len(text) <= limit:
        return text
    return "..." + text[3 - limit:] if tail else text[:limit - 3] + "..."


def constant_reward_hint(score_fn: Callable[[list[str], list[str], list[Any], list[Any]], list[float]],
                         reward_name: str, value: float, steps: Sequence[int], prompts: Sequence[str],
                         responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                         extra_infos: Sequence[Any], finish_reasons: Sequence[str], max_response_length: int,
                         critic: bool = False) -> str:
    """Lines explaining a reward that was ``value`` for every sample of the training ``steps``.

    ``score_fn(data_sources, responses, ground_truths, extra_infos)`` scores texts with the run's
    reward function; the first sample is the example. ``critic``: the advantages come from a value
    function (GAE), so they are not zero, but they carry nothing about which response is better.
    """
    count = len(responses)
    truth = str(ground_truths[0])
    source, extra = data_sources[0], extra_infos[0]
    probes = [truth] + [fmt.wrap(truth) for fmt in ANSWER_FORMATS] + [NON_ANSWER]
    *scores, baseline = score_fn([source] * len(probes), probes, [ground_truths[0]] * len(probes),
                                 [extra] * len(probes))
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    effect = ("no response scores better than another, so the advantages (the critic's errors) say nothing about "
              "which answer is better and the policy learns nothing from the reward" if critic else
              "GRPO-style advantages are all zero and nothing is learned")
    lines = [f"hint: every reward of {span} is {value:g} ({count} samples): {effect}. One sample:",
             f"  prompt: {_one_line(prompts[0], tail=True)}",
             f"  response: {_one_line(responses[0])}",
             f"  ground truth: {_one_line(truth)} | score: {value:g} | reward: {reward_name}"]
    if baseline > value:
        lines.append(f"  a non-answer scored alone gets {baseline:g}, more than the responses' {value:g}: a penalty on "
                     "the responses lowers every reward (DAPO's overlong penalty, reward_model.overlong_buffer, for "
                     "responses near data.max_response_length)")
    rewarded = [(fmt, s) for fmt, s in zip(ANSWER_FORMATS, scores[1:]) if s > baseline]
    if scores[0] > baseline:
        lines.append(f"  the reward function gives {scores[0]:g} to the bare answer '{_one_line(truth, 40)}': the "
                     "responses are wrong, not badly formatted (a task too hard to start from, or a prompt that "
                     "does not say what to answer)")
    elif rewarded:
        fmt, best = rewarded[0]
        cause = (f"  likely cause: the reward function expects {fmt.name} (it gives {best:g} to "
                 f"'{_one_line(fmt.wrap(truth), 40)}' but {scores[0]:g} to the bare answer)")
        if not any(fmt.marker in r for r in responses):
            cause += f"; no response contains '{fmt.marker}'"
        if not any(fmt.marker in p for p in prompts):
            cause += "; the prompts never ask for it"
        lines.append(cause)
    else:
        lines.append(f"  the reward function gives {baseline:g} even to the ground truth itself, bare and as "
                     f"{', '.join(f.name for f in ANSWER_FORMATS)}: check the reward function and the data's "
                     "reward_model.ground_truth")
    truncated = sum(1 for f in finish_reasons if f == "length")
    if truncated == count:
        lines.append(f"  every response stopped at the length limit ({max_response_length} tokens, "
                     "data.max_response_length): the answer may come after it")
    empty = sum(1 for r in responses if not str(r).strip())
    if empty:
        lines.append(f"  {empty} of {count} responses are empty")
    return "\n".join(lines)
