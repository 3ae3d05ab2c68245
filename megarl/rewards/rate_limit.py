"""The ``rate_limited`` reward manager's limits (verl's ``rate_limited``, for external judges and APIs).

``RateLimits.run(call)`` awaits one reward-function call within four limits, in verl's order:
requests per minute (``reward_model.max_rpm``), tokens per minute (``reward_model.max_tpm``, each
call counted as ``estimated_tokens_per_request``), calls in flight (``reward_model.max_concurrent``)
and a time limit per call (``reward_model.timeout`` seconds; a call over it raises
``CallTimedOut``, and the manager scores the sample ``reward_model.judge.fallback_score``). The
per-minute limits are leaky buckets (``aiolimiter``) that start full, so a burst of up to one
minute's budget goes at once. The limits hold per event loop: the manager runs a batch's calls in
one loop in the controller.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable


class CallTimedOut(TimeoutError):
    """A reward-function call ran longer than ``reward_model.timeout``."""


@dataclass(frozen=True)
class LimitSettings:
    max_concurrent: int = 1
    max_rpm: int | None = None
    max_tpm: int | None = None
    estimated_tokens_per_request: int = 2000
    timeout_s: float = 300.0

    def problems(self) -> list[str]:
        found = []
        if self.max_concurrent < 1:
            found.append(f"reward_model.max_concurrent={self.max_concurrent}: must be >= 1")
        for key, value in (("max_rpm", self.max_rpm), ("max_tpm", self.max_tpm)):
            if value is not None and value < 1:
                found.append(f"reward_model.{key}={value}: must be >= 1 (or null: no limit)")
        if self.estimated_tokens_per_request < 1:
            found.append(f"reward_model.estimated_tokens_per_request={self.estimated_tokens_per_request}: must be >= 1")
        elif self.max_tpm is not None and self.estimated_tokens_per_request > self.max_tpm:
            found.append(f"reward_model.estimated_tokens_per_request={self.estimated_tokens_per_request} exceeds "
                         f"reward_model.max_tpm={self.max_tpm}: no call could ever start")
        if not self.timeout_s > 0:
            found.append(f"reward_model.timeout={self.timeout_s}: must be > 0 seconds")
        return found


class RateLimits:
    """The limits of one batch's calls (create it inside the event loop that runs them)."""

    def __init__(self, settings: LimitSettings):
        from aiolimiter import AsyncLimiter

        self.settings = settings
        self._concurrent = asyncio.Semaphore(settings.max_concurrent)
        self._rpm = AsyncLimiter(settings.max_rpm, 60) if settings.max_rpm else None
        self._tpm = AsyncLimiter(settings.max_tpm, 60) if settings.max_tpm else None

    async def run(self, call: Callable[[], Awaitable[Any]]) -> Any:
        if self._rpm is not None:
            await self._rpm.acquire(1)
        if self._tpm is not None:
            await self._tpm.acquire(self.settings.estimated_tokens_per_request)
        async with self._concurrent:
            try:
                return await asyncio.wait_for(call(), self.settings.timeout_s)
            except asyncio.TimeoutError:
                raise CallTimedOut(f"the reward function ran longer than reward_model.timeout="
                                   f"{self.settings.timeout_s:g} s") from None
