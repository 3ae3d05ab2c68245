"""verl's reward managers (``reward_model.reward_manager``, or ``reward.reward_manager.name``).

* ``naive`` (default): the reward function's score;
* ``dapo``: the score plus DAPO's soft overlong penalty (arXiv:2503.14476) when it is enabled,
  and the score recorded as ``acc`` when the function returns a number (verl's DAPO manager);
* ``batch``: the function is called once per batch; it must have one of the batch forms
  (``megarl.rewards.custom``). A batch-form function is called that way under any manager;
* ``rate_limited`` (verl's name; ``limited``, the name of verl's module, is accepted too): the
  calls of a batch run concurrently within ``reward_model.max_concurrent``, ``max_rpm``,
  ``max_tpm`` and ``timeout`` (``megarl.rewards.rate_limit``), for judges and APIs with quotas.

The manager's keyword arguments are ``reward_model.reward_kwargs`` (verl's place; 2026:
``reward.reward_kwargs``): every manager takes ``compute_score_timeout`` (verl's naive manager's;
read as ``reward.compute_score_timeout``, ``compute_score_timeout``), ``dapo`` also ``max_resp_len`` and ``overlong_buffer_cfg``
(``enable``, ``len``, ``penalty_factor``, ``log``); ``batch`` passes them on to the reward
function, as verl's batch manager does; ``naive`` takes none. The DAPO recipe's older
place, ``reward_model.overlong_buffer.*`` with ``max_resp_len = data.max_response_length``,
means the same. The penalty for a response of ``L`` tokens, with ``expected = max_resp_len - len``:
``min(-(L - expected) / len * penalty_factor, 0)``.
"""
from __future__ import annotations

from dataclasses import dataclass


REWARD_MANAGERS = ("naive", "dapo", "batch", "rate_limited")
MANAGER_ALIASES = {"limited": "rate_limited"}
VERL_ONLY_MANAGERS = ("prime", "remote", "gdpo")  # verl registers these too
DAPO_KWARGS = ("max_resp_len", "overlong_buffer_cfg")
TIMEOUT_KWARG = "compute_score_timeout"  # verl's naive manager takes it; megarl's key is reward.compute_score_timeout
OVERLONG_KEYS = ("enable", "len", "penalty_factor", "log")


@dataclass(frozen=True)
class OverlongPenalty:
    buffer_len: int
    penalty_factor: float
    max_resp_len: int
    log: bool  # also report reward/overlong_reward and reward/overlong per sample

    def __call__(self, response_length: int) -> float:
        expected = self.max_resp_len - self.buffer_len
        return min(-(response_length - expected) / self.buffer_len * self.penalty_factor, 0.0)


def canonical_manager(name: str) -> str:
    """The registry name of a manager (``limited`` -> ``rate_limited``)."""
    return MANAGER_ALIASES.get(name, name)


