"""Sampling settings of a rollout: verl's rollout keys -> one checked ``Sampling`` -> vLLM kwargs.

The training defaults come from ``actor_rollout_ref.rollout`` (``n``, ``temperature``, ``top_p``,
``top_k``, ``do_sample``, ``response_length``, ``stop``); validation uses ``rollout.val_kwargs``
(greedy by default). A call may override any of them with a small dict using the same key names;
an unknown key is an error, not silently ignored.

Seeds: every prompt gets its own request seed, derived from (``rollout.seed``, step, prompt
index); vLLM gives the k-th of the prompt's n samples the seed ``request_seed + k``. So a sampled
output depends only on (seed, step, prompt index, sample index) and the weights, never on which
replica served the prompt or on what else was in the batch.

Log-probs (``rollout.logprobs_mode``). With ``processed_logprobs`` (the default, verl's) the fleet
reports ``log p(token)`` under the distribution it sampled from: ``log_softmax(logits / T)``, and
with top-k / top-p the tokens outside the kept set get probability 0 and the rest are
renormalised, so a sampled token's log-prob is ``log_softmax(logits / T)[token] - log(mass kept)``.
The trainer scores ``log_softmax(logits / T)`` over the whole vocabulary (it has no top-k/top-p):
at ``top_p=1, top_k=-1`` both are the same distribution (``rollout/logprob_diff`` ~1e-6 with
equal weights), with top-p/top-k the trainer's log-prob is lower by ``-log(mass kept)`` at every
token, and an importance weight ``pi_trainer / pi_rollout`` is that mass (< 1): the truncation is
part of the behaviour policy, which a rollout correction sees as such (verl behaves the same).
Greedy requests (validation) report ``log_softmax(logits)``. ``raw_logprobs`` (before temperature,
top-k, top-p) equals the processed form only at ``T=1`` without top-k/top-p; the config check
refuses it elsewhere for training.
"""
from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

# Keys a caller may override per call; "max_tokens" is accepted as vLLM's name for response_length.
SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "do_sample", "response_length", "max_tokens",
                 "stop", "ignore_eos")


@dataclass(frozen=True)
class Sampling:
    """Checked sampling settings for one ``generate`` call (greedy when ``temperature == 0``)."""

    n: int
    temperature: float
    top_p: float
    top_k: int  # -1: off (verl's convention); vLLM also reads -1 as off
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def engine_kwargs(self) -> dict[str, Any]:
        """What a replica's ``generate`` takes, for every backend: ``vllm.SamplingParams``'s names
        but the per-request ``seed``. ``logprobs=0`` returns the log-prob of the sampled token only.
        """
        return dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop=list(self.stop) or None,
            ignore_eos=self.ignore_eos,
            logprobs=0,
        )


def resolve_sampling(config: Any, overrides: Mapping[str, Any] | None = None, n: int | None = None,
                     validate: bool = False) -> Sampling:
    """The sampling for one call: config defaults (``val_kwargs`` when ``validate``), then overrides, then ``n``."""
    source = config.val_kwargs if validate else config
    values: dict[str, Any] = dict(
        n=source.n, temperature=source.temperature, top_p=source.top_p, top_k=source.top_k,
        do_sample=source.do_sample, max_tokens=config.response_length, stop=list(config.stop or []),
        ignore_eos=bool(getattr(config, "ignore_eos", False) or False),  # rollout.ignore_eos, validation included
    )
    for key, value in (overrides or {}).items():
        if key not in SAMPLING_KEYS:
            close = difflib.get_close_matches(str(key), SAMPLING_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown sampling key {key!r}{hint}; known keys: {', '.join(SAMPLING_KEYS)}")
        values["max_tokens" if key == "response_length" else key] = value
    if n is not None:
        values["n"] = n
    stop = values["stop"]
    values["stop"] = [stop] if isinstance(stop, str) else [] if stop is None else list(stop)

    _check(values)
    greedy = not values["do_sample"] or values["temperature"] == 0
    return Sampling(
        n=int(values["n"]),
        temperature=0.0 if greedy else float(values["temperature"]),
        top_p=1.0 if greedy else float(values["top_p"]),
        top_k=-1 if greedy else int(values["top_k"]),
        max_tokens=int(values["max_tokens"]),
        stop=tuple(values["stop"]),
        ignore_eos=bool(values["ignore_eos"]),
    )


def _check(values: dict[str, Any]) -> None:
    """Reject values vLLM would reject, before any request leaves the driver."""
    problems = []
    if not isinstance(values["n"], int) or values["n"] < 1:
        problems.append(f"n={values['n']!r} must be an integer >= 1")
    if not isinstance(values["max_tokens"], int) or values["max_tokens"] < 1:
        problems.append(f"response_length/max_tokens={values['max_tokens']!r} must be an integer >= 1")
    if not isinstance(values["temperature"], (int, float)) or values["temperature"] < 0:
        problems.append(f"temperature={values['temperature']!r} must be a number >= 0 (0 = greedy)")
    if not isinstance(values["top_p"], (int, float)) or not 0 < values["top_p"] <= 1:
        problems.append(f"top_p={values['top_p']!r} must be in (0, 1]")
    if not isinstance(values["top_k"], int) or values["top_k"] < -1:
        problems.append(f"top_k={values['top_k']!r} must be -1 (off) or an integer >= 1")
    stop = values["stop"]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        problems.append(f"stop={stop!r} must be a list of non-empty strings")
    if problems:
        raise ValueError("bad rollout sampling settings: " + "; ".join(problems))


def request_seed(base_seed: int, step: int, prompt_index: int) -> int:
    """A stable 31-bit seed for one prompt's request, independent of replica and batch."""
    digest = hashlib.sha256(f"megarl-rollout/{base_seed}/{step}/{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def turn_seed(base_seed: int, step: int, prompt_index: int, sample_index: int, turn: int) -> int:
    """The seed of one turn of one sample: depends on nothing but these five numbers.

    Turn 0 uses the seed the batch path gives that sample (``request_seed + sample_index``), so a
    single-turn rollout through the agent seam samples exactly what ``RolloutFleet.generate`` does.
    """
    if turn == 0:
        return request_seed(base_seed, step, prompt_index) + sample_index
    digest = hashlib.sha256(f"megarl-turn/{base_seed}/{step}/{prompt_index}/{sample_index}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1
