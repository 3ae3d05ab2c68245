"""verl's answer-check tools: the model submits an answer and is told whether it parses and scores.

``Gsm8kTool`` (verl: ``verl.tools.gsm8k_tool.Gsm8kTool``) and ``Geo3kTool``
(``verl.tools.geo3k_tool.Geo3kTool``) keep verl's behaviour: ``create`` takes the sample's
``ground_truth`` (from ``extra_info.tools_kwargs.<tool>.create_kwargs``), ``execute`` scores the
submitted ``answer`` and replies ``Current parsed answer='...' reward=...``; the step reward is 0.0
when the answer scores better than the previous one (verl compares with the last answer, not the
best: 72, 70, 72 for 72 give 0, -0.05, 0), else -0.05 (verl's penalty for resubmitting without
improving), and ``calc_reward`` is the score of the last answer.
GSM8K answers are scored with megarl's GSM8K rule (``flexible``: the last number, as verl's tool
does); Geo3k answers with megarl's MATH-style answer equivalence.
"""
from __future__ import annotations

from typing import Any

from megarl.agent.tools.base import BaseTool, ToolResponse
from megarl.rewards import gsm8k
from megarl.rewards.math_answer import answers_match

NOT_IMPROVED_PENALTY = -0.05


class _AnswerCheckTool(BaseTool):
    def score(self, answer: str, ground_truth: str) -> float:
        raise NotImplementedError

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any) -> str:
        if ground_truth is None:
            raise ValueError(f"tool {self.name!r} needs a ground_truth: put it in extra_info.tools_kwargs."
                             f"{self.name}.create_kwargs.ground_truth of the data")
        return await super().create(instance_id, ground_truth=str(ground_truth), response="", last=0.0)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        state = self.instance(instance_id)
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state["response"] = answer
        reward = self.score(answer, state["ground_truth"])
        step_reward = 0.0 if reward > state["last"] else NOT_IMPROVED_PENALTY
        state["last"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self.instance(instance_id)
        return self.score(state["response"], state["ground_truth"])


class Gsm8kTool(_AnswerCheckTool):
    def score(self, answer: str, ground_truth: str) -> float:
        if not answer.startswith("#### "):
            answer = "#### " + answer
        return gsm8k.compute_score(answer, ground_truth, method="flexible", format_score=0.0, score=1.0)


class Geo3kTool(_AnswerCheckTool):
    def score(self, answer: str, ground_truth: str) -> float:
        return 1.0 if answer.strip() and answers_match(answer.strip(), ground_truth) else 0.0
