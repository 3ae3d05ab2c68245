"""One generated response: what the trainer needs from a rollout, in plain Python types."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutSample:
    """The ``sample_index``-th response to prompt ``prompt_index`` of a ``generate`` call.

    ``logprobs[t]`` is the engine's log-probability of ``response_ids[t]`` given the prompt and
    ``response_ids[:t]``, under the distribution it was sampled from (the fleet's default
    ``logprobs_mode="processed_logprobs"``): ``log_softmax(logits / temperature)``, renormalised over
    the tokens top-k / top-p keep (see ``megarl.rollout.sampling``). Greedy requests report
    ``log_softmax(logits)`` (temperature 1), as ``RolloutFleet.compute_log_probs`` does.
    ``finish_reason`` is "stop" (EOS token or a stop string) or "length" (``max_tokens`` or
    ``max_model_len`` reached); ``stop_string`` names the stop string that ended the response, if one
    did (the text is cut before it; ``response_ids`` keep every generated token).
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_string: str | None
    response_text: str
    replica: int  # which engine replica served it (for logs and tests; results never depend on it)


@dataclass
class Generation:
    """One completion of one request (token in, token out): a turn of an agent loop.

    ``logprobs[t]`` is the engine's log-probability of ``token_ids[t]`` (as in ``RolloutSample``);
    ``versions[t]`` the weight version that sampled it (a generation interrupted by a weight sync
    continues on the new weights: its later tokens carry the later version). ``finish_reason`` is
    "stop" or "length"; ``stop_string`` the stop string that ended it, if one did; ``text`` the
    detokenised ``token_ids`` (cut before a stop string).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_string: str | None
    text: str
    versions: list[int] | None = None  # None: the engine did not say (a client other than a replica)


@dataclass
class TopkScores:
    """A sequence's tokens scored teacher-forced, with the engine's top-k at each scored position:
    ``log_probs[t]`` of the sequence's own token, ``topk_ids[t]`` / ``topk_log_probs[t]`` the ``k``
    most likely tokens there (most likely first), all ``log_softmax(logits)``."""

    log_probs: list[float]
    topk_ids: list[list[int]]
    topk_log_probs: list[list[float]]
