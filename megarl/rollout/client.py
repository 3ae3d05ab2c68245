"""A per-request generation client of one engine replica: what an agent loop talks to.

``GenerateClient.generate(prompt_ids, sampling, seed)`` sends one request (token ids in) to its
replica's async engine and returns one ``Generation`` (token ids and their log-probs out); many
such requests from many trajectories run concurrently and vLLM batches them. The client is
sticky: it always talks to the same replica, so the turns of a trajectory reuse its prefix cache.
It holds only Ray actor handles and a few numbers, so it can be sent to agent-loop workers.

If its replica is lost (its actor or its engine died), a request fails over: the client sends it
again, whole and with the same seed, to the next replica of the list it was given, and keeps
talking to that one. The turns a trajectory already has stay as they are (tokens and versions);
the fleet learns of the loss by its own health check (``RolloutFleet.restore``).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from megarl.rollout.replica_table import is_replica_lost, lost_cause
from megarl.rollout.sample import Generation
from megarl.rollout.sampling import Sampling

logger = logging.getLogger(__name__)


class GenerateClient:
    """``replicas``: ``(slot, handle)`` of the serving replicas; ``position``: the one to talk to."""

    def __init__(self, replicas: Sequence[tuple[int, Any]], position: int, max_model_len: int, vocab_size: int):
        if not 0 <= position < len(replicas):
            raise ValueError(f"position={position}: the client was given {len(replicas)} replicas")
        self._replicas = list(replicas)
        self._position = position
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    @property
    def replica(self) -> int:
        """The slot of the replica this client talks to now."""
        return self._replicas[self._position][0]

    async def _call(self, method: str, *args):
        """``method(*args)`` on the current replica; on the next one if it is lost (all tried once)."""
        for _ in range(len(self._replicas)):
            slot, handle = self._replicas[self._position]
            try:
                return await getattr(handle, method).remote(*args)
            except Exception as exc:  # noqa: BLE001 - only a lost replica is routed around
                if not is_replica_lost(exc) or len(self._replicas) == 1:
                    raise
                self._position = (self._position + 1) % len(self._replicas)
                logger.warning("rollout replica %d lost (%s): its request goes to replica %d", slot,
                               lost_cause(exc), self.replica)
        raise RuntimeError(f"every rollout replica this client knows ({[s for s, _ in self._replicas]}) is lost")

    def room(self, num_tokens: int) -> int:
        """How many tokens the engine can still generate after a context of ``num_tokens``."""
        return self.max_model_len - num_tokens

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int,
                       max_tokens: int | None = None, images: Sequence = ()) -> Generation:
        """One completion of ``prompt_ids`` with ``sampling`` (its ``n`` is ignored: one sample),
        at most ``max_tokens`` tokens (default ``sampling.max_tokens``), seeded with ``seed``; ``images``:
        a vision-language prompt's images, one per run of image tokens in ``prompt_ids``."""
        ids, limit = self._check(prompt_ids, sampling, max_tokens)
        kwargs = {**sampling.engine_kwargs(), "n": 1, "max_tokens": limit}
        return await self._call("generate_tokens", ids, kwargs, int(seed), list(images))

    async def generate_group(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int, n: int,
                             max_tokens: int | None = None, images: Sequence = ()) -> list[Generation]:
        """``n`` completions of ``prompt_ids`` in one engine request: the k-th equals
        ``generate(prompt_ids, sampling, seed + k, max_tokens, images)``."""
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one completion")
        ids, limit = self._check(prompt_ids, sampling, max_tokens)
        kwargs = {**sampling.engine_kwargs(), "n": int(n), "max_tokens": limit}
        return await self._call("generate_group", ids, kwargs, int(seed), list(images))

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
