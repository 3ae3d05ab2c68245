"""What an agent loop returns: one sample's tokens, its loss mask and log-probs, and its extras.

Layout of a response (verl's): ``|<- model ->|<- tool ->|<- model ->|`` with loss mask
``1..1 0..0 1..1``. Model tokens carry the engine's log-probs and the weight version that sampled
them; every other token (tool responses, the chat template's turn markers around them) carries
mask 0, log-prob 0.0 and version -1, so it is context for the next turn but never trained on. ``TrajectoryBuilder`` enforces the response budget
(``rollout.response_length``: model and tool tokens together) while the loop appends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class Trajectory:
    """One sample: the prompt and everything appended after it, token by token.

    ``finish_reason``: ``stop`` (the model ended its turn and the loop ended), ``length`` (the
    response budget or the engine's context ran out), ``max_turns`` (``max_assistant_turns`` or
    ``max_user_turns`` reached). ``extras`` are per-sample facts that become step-data fields of the
    same name (numbers, strings or lists): e.g. ``num_turns``, ``tool_calls``, ``tool_reward``.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    finish_reason: str
    response_text: str
    extras: dict[str, Any] = field(default_factory=dict)
    versions: list[int] | None = None  # per response token: the weight version that sampled it (-1: not sampled
    # or not known); None: the loop did not record them

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if self.versions is not None and len(self.versions) != n:
            raise ValueError(f"a trajectory needs one version per response token: {n} tokens, "
                             f"{len(self.versions)} versions")
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"a trajectory needs one loss-mask entry and one log-prob per response token: "
                             f"{n} tokens, {len(self.loss_mask)} mask entries, {len(self.logprobs)} log-probs")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        if any(lp != 0.0 for lp, m in zip(self.logprobs, self.loss_mask) if m == 0):
            raise ValueError("tokens with loss mask 0 must carry log-prob 0.0 (they were not sampled by the model)")

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @classmethod
    def from_sample(cls, sample: Any) -> "Trajectory":
        """A single-turn trajectory from a ``RolloutSample`` of ``RolloutFleet.generate``."""
        return cls(list(sample.prompt_ids), list(sample.response_ids), [1] * len(sample.response_ids),
                   list(sample.logprobs), sample.finish_reason, sample.response_text, {"num_turns": 2},
                   getattr(sample, "versions", None))


class TrajectoryBuilder:
    """Appends model and environment tokens after a prompt, within a token budget."""

    def __init__(self, prompt_ids: Sequence[int], budget: int):
        if budget < 1:
            raise ValueError(f"response budget {budget} must be >= 1 (rollout.response_length)")
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.budget = int(budget)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.known_versions = True

    @property
    def room(self) -> int:
        """Tokens left in the response budget."""
        return self.budget - len(self.response_ids)

    @property
    def context(self) -> list[int]:
        """Everything so far: what the model sees next."""
        return self.prompt_ids + self.response_ids

    def add_model(self, token_ids: Sequence[int], logprobs: Sequence[float],
                  versions: Sequence[int] | None = None) -> bool:
        """Append sampled tokens (mask 1) with their log-probs and versions (``Generation.versions``);
        False if the budget cut them."""
        if len(token_ids) != len(logprobs) or (versions is not None and len(versions) != len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs / "
                             f"{None if versions is None else len(versions)} versions from the engine")
        keep = min(len(token_ids), self.room)
        self.response_ids += [int(t) for t in token_ids[:keep]]
        self.loss_mask += [1] * keep
        self.logprobs += [float(lp) for lp in logprobs[:keep]]
        self.versions += [int(v) for v in versions[:keep]] if versions is not None else [-1] * keep
        self.known_versions &= versions is not None
        return keep == len(token_ids)

    def add_env(self, token_ids: Sequence[int]) -> bool:
        """Append tokens the model did not sample (mask 0, log-prob 0); False if the budget cut them."""
        keep = min(len(token_ids), self.room)
        self.response_ids += [int(t) for t in token_ids[:keep]]
        self.loss_mask += [0] * keep
        self.logprobs += [0.0] * keep
        self.versions += [-1] * keep
        return keep == len(token_ids)

    def build(self, finish_reason: str, response_text: str, **extras: Any) -> Trajectory:
        return Trajectory(self.prompt_ids, self.response_ids, self.loss_mask, self.logprobs, finish_reason,
                          response_text, extras, list(self.versions) if self.known_versions else None)
