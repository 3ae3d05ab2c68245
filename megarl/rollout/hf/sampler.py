"""One token per row from the logits, as vLLM's sampler does, with one random stream per request.

``RowSampling`` is one request's settings, read from ``Sampling.engine_kwargs()`` (vLLM's
``SamplingParams`` names) and checked as vLLM checks them. ``sample_rows`` turns a batch of
last-position logits into tokens and their log-probs, row by row equal to what that row would get
alone:

* greedy (``temperature < 1e-5``): the argmax; its log-prob is ``log_softmax(logits)`` (vLLM's
  greedy requests report temperature 1);
* sampled: ``logits / T``, then top-k (keep the tokens whose logit is at least the k-th largest,
  ties kept), then top-p on what top-k kept (ascending sort, drop the tokens whose cumulative
  probability stays ``<= 1 - p``, keep at least the most likely one): vLLM's
  ``apply_top_k_top_p_pytorch``. The token is drawn by inverse CDF from one uniform number of the
  row's own ``torch.Generator`` (seeded per request), so a row's token depends only on its seed,
  its logits and how many tokens it has drawn, never on the other rows of the batch;
* log-probs (``logprobs_mode``): ``processed_logprobs`` (the default) are the log-softmax of the
  processed logits (temperature, top-k, top-p applied: the distribution sampled from);
  ``raw_logprobs`` the log-softmax of the model's logits.

The random numbers are not vLLM's (its CPU sampler hashes seeds into Gumbel noise), so sampled
tokens differ from vLLM's for the same seed; greedy tokens and every log-prob agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
KNOWN_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs")


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling settings (vLLM's ``SamplingParams`` meaning)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = True  # vLLM's logprobs=None returns none

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "RowSampling":
        """Read ``Sampling.engine_kwargs()``-style keys; an unknown key or a bad value is an error."""
        unknown = sorted(set(kwargs) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"sampling keys {unknown} are not supported by the hf rollout backend; it reads "
                             f"{', '.join(KNOWN_KEYS)} (vLLM's SamplingParams names)")
        stop = kwargs.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        logprobs = kwargs.get("logprobs", 0)
        settings = cls(n=int(kwargs.get("n", 1)), temperature=float(kwargs.get("temperature", 1.0)),
                       top_p=float(kwargs.get("top_p", 1.0)), top_k=int(kwargs.get("top_k", -1) or -1),
                       max_tokens=int(kwargs.get("max_tokens", 16)), stop=stop,
                       stop_token_ids=tuple(int(t) for t in kwargs.get("stop_token_ids") or ()),
                       ignore_eos=bool(kwargs.get("ignore_eos", False)), logprobs=logprobs is not None)
        problems = []
        if settings.n < 1:
            problems.append(f"n={settings.n} must be >= 1")
        if settings.temperature < 0:
            problems.append(f"temperature={settings.temperature} must be >= 0")
        if not 0 < settings.top_p <= 1:
            problems.append(f"top_p={settings.top_p} must be in (0, 1]")
        if settings.top_k < -1:
            problems.append(f"top_k={settings.top_k} must be -1, 0 (off) or >= 1")
        if settings.max_tokens < 1:
            problems.append(f"max_tokens={settings.max_tokens} must be >= 1")
        if logprobs is not None and int(logprobs) < 0:
            problems.append(f"logprobs={logprobs} must be None or >= 0")
        if not all(isinstance(s, str) and s for s in settings.stop):
            problems.append(f"stop={list(settings.stop)} must be non-empty strings")
        if problems:
            raise ValueError("bad sampling settings: " + "; ".join(problems))
        return settings


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p_pytorch`` with one ``k`` and ``p`` per row (k = vocab, p = 1: off)."""
    values, order = logits.sort(dim=-1, descending=False)
    threshold = values.gather(1, (logits.shape[1] - k).unsqueeze(1))
    values = values.masked_fill(values < threshold, float("-inf"))
    cumulative = values.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p.unsqueeze(1)
    drop[:, -1] = False  # at least one
    values = values.masked_fill(drop, float("-inf"))
    return logits.scatter(-1, order, values)


def sample_rows(logits: torch.Tensor, settings: Sequence[RowSampling], generators: Sequence[torch.Generator | None],
                logprobs_mode: str = "processed_logprobs") -> tuple[list[int], list[float]]:
    """Tokens and their log-probs for a batch of rows (``logits``: [rows, vocab], any dtype).

    ``generators[i]`` (a CPU generator) draws row i's uniform number; greedy rows draw none.
    """
    logits = logits.float()
    rows, vocab = logits.shape
    greedy = torch.tensor([s.greedy for s in settings], device=logits.device)
    temperature = torch.tensor([1.0 if s.greedy else s.temperature for s in settings], device=logits.device)
    processed = logits / temperature.unsqueeze(1)
    filtered = [i for i, s in enumerate(settings) if not s.greedy and (0 < s.top_k < vocab or s.top_p < 1)]
    if filtered:
        index = torch.tensor(filtered, device=logits.device)
        k = torch.tensor([settings[i].top_k if 0 < settings[i].top_k < vocab else vocab for i in filtered],
                         device=logits.device)
        p = torch.tensor([settings[i].top_p for i in filtered], device=logits.device, dtype=torch.float32)
        processed = processed.index_copy(0, index, top_k_top_p(processed[index], k, p))
    logp = torch.log_softmax(processed, dim=-1)
    uniform = torch.tensor([float(torch.rand((), generator=g, dtype=torch.float64)) if not s.greedy else 0.0
                            for s, g in zip(settings, generators)], dtype=torch.float64, device=logits.device)
    cumulative = logp.double().exp().cumsum(dim=-1)
    drawn = torch.searchsorted(cumulative, (uniform * cumulative[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last_kept = vocab - 1 - torch.isfinite(logp).flip(-1).int().argmax(-1)  # rounding past the end: the last kept
    drawn = torch.minimum(drawn, last_kept)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    reported = torch.log_softmax(logits, dim=-1) if logprobs_mode == "raw_logprobs" else logp
    values = reported.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), values.tolist()
