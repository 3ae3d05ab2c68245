"""A per-request generation client of one engine replica: what an agent loop talks to.

``GenerateClient.generate(prompt_ids, sampling, seed)`` sends one request (token ids in) to its
replica's async engine and returns one ``Generation`` (token ids and their log-probs out); many
such requests from many trajectories run concurrently and vLLM batches them. The client is
sticky: it always talks to the same replica, so the turns of a trajectory reuse its prefix cache.
It holds only a Ray actor handle and a few numbers, so it can be sent to agent-loop workers.
"""
from __future__ import annotations

from typing import Any, Sequence

from megarl.rollout.sample import Generation
from megarl.rollout.sampling import Sampling


class GenerateClient:
    def __init__(self, handle: Any, replica: int, max_model_len: int, vocab_size: int):
        self._handle = handle
        self.replica = replica
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def room(self, num_tokens: int) -> int:
        """How many tokens the engine can still generate after a context of ``num_tokens``."""
        return self.max_model_len - num_tokens

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int,
                       max_tokens: int | None = None) -> Generation:
        """One completion of ``prompt_ids`` with ``sampling`` (its ``n`` is ignored: one sample),
        at most ``max_tokens`` tokens (default ``sampling.max_tokens``), seeded with ``seed``."""
        ids, limit = self._check(prompt_ids, sampling, max_tokens)
        kwargs = {**sampling.engine_kwargs(), "n": 1, "max_tokens": limit}
        return await self._handle.generate_tokens.remote(ids, kwargs, int(seed))

    async def generate_group(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int, n: int,
                             max_tokens: int | None = None) -> list[Generation]:
        """``n`` completions of ``prompt_ids`` in one engine request: the k-th equals
        ``generate(prompt_ids, sampling, seed + k, max_tokens)``."""
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one completion")
        ids, limit = self._check(prompt_ids, sampling, max_tokens)
        kwargs = {**sampling.engine_kwargs(), "n": int(n), "max_tokens": limit}
        return await self._handle.generate_group.remote(ids, kwargs, int(seed))

    def _check(self, prompt_ids: Sequence[int], sampling: Sampling, max_tokens: int | None) -> tuple[list[int], int]:
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("generate needs at least one prompt token")
        limit = sampling.max_tokens if max_tokens is None else int(max_tokens)
        if limit < 1:
            raise ValueError(f"max_tokens={limit}: nothing left to generate")
        if len(ids) + limit > self.max_model_len:
            raise ValueError(f"{len(ids)} context tokens + max_tokens={limit} exceed the engine's max_model_len="
                             f"{self.max_model_len}; cap max_tokens with room()")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids, limit
