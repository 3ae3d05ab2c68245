"""The LLM-judge client a reward function calls, and a parser for the judge's scores.

    async def compute_score(data_source, solution_str, ground_truth, extra_info, judge):
        prompt = [{"role": "user", "content": f"Rate 0-10: {solution_str}\\nScore:"}]
        (answer,) = await judge.agenerate([prompt], {"max_tokens": 8})
        score = parse_score(answer, 0, 10)
        if score is None:
            raise JudgeError(f"no score in {answer!r}")   # the sample gets the fallback score, counted
        return score / 10

``JudgeClient`` talks HTTP to the judge's OpenAI-compatible server (vLLM's, in each judge replica,
behind one address: ``reward_router_address``): a prompt given as chat messages goes to
``/v1/chat/completions`` (the judge's chat template is applied there), a string to
``/v1/completions`` (already templated, e.g. with ``reward_model_tokenizer``). ``sampling`` holds
OpenAI / vLLM request fields (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``allowed_token_ids``, ...); without them the judge answers greedily within its response budget.

Failure handling (``reward_model.judge.*``): at most ``max_concurrent`` requests in flight per
process; each request is bounded by ``timeout_s``; server errors (5xx), 408/429, timeouts and lost
connections are retried ``max_retries`` times with exponential backoff and jitter (tenacity);
request errors (other 4xx: a prompt over the judge's context, a bad field) are not. A request that
still fails raises ``JudgeError``: the reward manager then scores the sample
``judge.fallback_score`` and counts it (``reward/judge_failures``), so a dead judge never hangs or
stops a step. A reward function raises ``JudgeError`` itself for an answer it cannot parse.

The client holds no connection or event loop between calls, so it pickles (reward worker
processes get their own copy) and works from any thread (``generate``) or coroutine (``agenerate``).
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import weakref
from collections import Counter
from typing import Any, Sequence

from megarl.rewards.reward_models.settings import JudgeSettings

logger = logging.getLogger(__name__)

RETRIED_STATUS = (408, 429)  # besides 5xx: a timeout or a rate limit of the server is worth another try
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


class JudgeError(RuntimeError):
    """The judge gave no usable answer: the sample is scored ``reward_model.judge.fallback_score``."""


class JudgeRequestError(JudgeError):
    """The judge refused the request (HTTP 4xx): retrying the same request cannot help."""


class _Transient(Exception):
    """A failure worth retrying (5xx, 408/429, a timeout, a lost connection)."""


class JudgeClient:
    """Requests to the judge at ``address`` (``host:port``) serving ``model`` (its name there)."""

    def __init__(self, address: str, model: str, settings: JudgeSettings | None = None,
                 default_sampling: dict[str, Any] | None = None):
        self.address, self.model = address, model
        self.settings = settings or JudgeSettings()
        self.default_sampling = dict(default_sampling or {"temperature": 0.0})
        self.stats: Counter = Counter()  # requests, retries, failures: of this process's calls
        self._init_local()

    def _init_local(self) -> None:
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> semaphore
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_limits", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_local()

    def __repr__(self) -> str:
        return f"JudgeClient(address={self.address!r}, model={self.model!r})"

    # ------------------------------------------------------------------ calls
    def generate(self, prompts: Sequence[str | list[dict]], sampling: dict[str, Any] | None = None) -> list[str]:
        """One answer per prompt (from a thread without a running event loop: a sync reward function)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(prompts, sampling))
        raise RuntimeError("JudgeClient.generate was called inside a running event loop (an async reward "
                           "function): use `await judge.agenerate(...)` there")

    async def agenerate(self, prompts: Sequence[str | list[dict]], sampling: dict[str, Any] | None = None) -> list[str]:
        """One answer per prompt, the requests concurrent (within ``max_concurrent``)."""
        import httpx

        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            raise TypeError("agenerate takes a list of prompts (strings, or lists of chat messages)")
        fields = {**self.default_sampling, **dict(sampling or {})}
        if fields.get("n", 1) != 1:
            raise ValueError(f"the judge client returns one answer per prompt; got n={fields['n']} (send the "
                             "prompt several times, with different seeds)")
        timeout = httpx.Timeout(self.settings.timeout_s)
        async with httpx.AsyncClient(base_url=f"http://{self.address}", timeout=timeout) as client:
            return list(await asyncio.gather(*(self._ask(client, p, fields) for p in prompts)))

    async def _ask(self, client, prompt: str | list[dict], fields: dict[str, Any]) -> str:
        from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

        chat = not isinstance(prompt, str)
        body = {"model": self.model, ("messages" if chat else "prompt"): prompt, **fields}
        retrying = AsyncRetrying(stop=stop_after_attempt(self.settings.max_retries + 1),
                                 wait=wait_exponential_jitter(multiplier=self.settings.retry_backoff_s, max=30,
                                                              jitter=self.settings.retry_backoff_s),
                                 retry=retry_if_exception_type(_Transient), reraise=True)
        async with self._limit():
            try:
                async for attempt in retrying:
                    with attempt:
                        if attempt.retry_state.attempt_number > 1:
                            self.stats["retries"] += 1
                        return await self._post(client, CHAT if chat else COMPLETION, body, chat)
            except _Transient as exc:
                self.stats["failures"] += 1
                raise JudgeError(f"the judge at {self.address} failed {self.settings.max_retries + 1} time(s): "
                                 f"{exc}") from None
            except JudgeRequestError:
                self.stats["failures"] += 1
                raise
        raise AssertionError("tenacity returns or raises")

    async def _post(self, client, path: str, body: dict, chat: bool) -> str:
        import httpx

        self.stats["requests"] += 1
        try:
            response = await asyncio.wait_for(client.post(path, json=body), self.settings.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            raise _Transient(f"no answer within {self.settings.timeout_s:g} s ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        status = response.status_code
        if status >= 500 or status in RETRIED_STATUS:
            raise _Transient(f"HTTP {status}: {response.text[:200]}")
        if status >= 400:
            raise JudgeRequestError(f"the judge refused the request (HTTP {status}, not retried): {response.text[:300]}")
        try:
            choice = response.json()["choices"][0]
            return choice["message"]["content"] if chat else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(f"the judge's answer has no choices[0] text: {response.text[:200]}") from exc

    def _limit(self) -> asyncio.Semaphore:
        """This event loop's semaphore: ``max_concurrent`` requests in flight per loop (per process for a
        function that is awaited, or one loop per thread)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            semaphore = self._limits.get(loop)
            if semaphore is None:
                semaphore = self._limits[loop] = asyncio.Semaphore(self.settings.max_concurrent)
        return semaphore


# ---------------------------------------------------------------------- parsing judgements
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_TAGGED = (
    re.compile(rf"<score>\s*({_NUMBER})\s*</score>", re.IGNORECASE),
    re.compile(rf"\\boxed\{{\s*({_NUMBER})\s*\}}"),
    re.compile(rf"\b(?:score|rating|grade)\s*(?:is|=|:)?\s*\**\s*({_NUMBER})", re.IGNORECASE),
    re.compile(rf"({_NUMBER})\s*/\s*\d+(?:\.\d+)?"),  # "7/10"
)


def parse_score(text: Any, low: float | None = None, high: float | None = None) -> float | None:
    """The score in a judge's answer, or None when there is none (or it lies outside [low, high]).

    Tried in order, the last match of each winning: ``<score>7</score>``, ``\\boxed{7}``,
    ``Score: 7`` / ``rating = 7`` / ``grade is 7``, ``7/10``; then the last number of the text.
    """
    if not isinstance(text, str) or not text.strip():
        return None
    for pattern in _TAGGED:
        found = pattern.findall(text)
        if found:
            return _in_range(float(found[-1]), low, high)
    numbers = re.findall(_NUMBER, text)
    return _in_range(float(numbers[-1]), low, high) if numbers else None


def _in_range(value: float, low: float | None, high: float | None) -> float | None:
    if (low is not None and value < low) or (high is not None and value > high):
        return None
    return value
