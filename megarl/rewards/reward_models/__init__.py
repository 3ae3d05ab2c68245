"""Model-based rewards: a discriminative reward model or an LLM judge, served by vLLM replicas.

``settings`` (what the config asks for, and its checks), ``inputs`` (what a reward model reads),
``service`` (the replicas, their HTTP servers and scores), ``judge`` (the client a reward function
calls, and a score parser), ``router`` (one address for several replicas). docs/rewards.md,
Reward models and LLM judges.
"""
from megarl.rewards.reward_models.inputs import ResponsesToScore
from megarl.rewards.reward_models.judge import JudgeClient, JudgeError, JudgeRequestError, parse_score
from megarl.rewards.reward_models.settings import DISCRIMINATIVE, GENERATIVE, JudgeSettings

__all__ = ["DISCRIMINATIVE", "GENERATIVE", "JudgeClient", "JudgeError", "JudgeRequestError", "JudgeSettings",
           "ResponsesToScore", "parse_score"]
