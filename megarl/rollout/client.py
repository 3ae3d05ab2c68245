"""A per-request generation client of one engine replica: what an agent loop talks to.

``GenerateClient.generate(prompt_ids, sampling, seed)`` sends one request (token ids in) to its
replica's async engine and returns one ``Generation`` (token ids and their log-probs out); many
such requests from many trajectories run concurrently and vLLM batches them. The client is
sticky: it always talks to the same replica, so the turns of a trajectory reuse its prefix cache.
It holds only a Ray actor handle and a few numbers, so it can be sent to agent-loop workers.

Requests are coalesced: those made to one replica in the same event-loop tick (all samples of a
step's first turn, the trajectories whose tool calls finished together) travel as one Ray call,
``generate_tokens_many``, whose results stream back as requests finish (those of one engine step
together), so a trajectory never waits for another's turn. One Ray call per request cost about 0.9 ms each on 2
cores (issue 19's measurement: 115 ms of a 128-sample step). A replica serves the batches with
``ServesRequestBatches``; results do not depend on the batching (every request has its own seed).
"""
from __future__ import annotations

import asyncio
import weakref
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
        kwargs = {**sampling.vllm_kwargs(), "n": 1, "max_tokens": limit}
        return await _batcher(self._handle).submit((ids, kwargs, int(seed)))


# one batcher per event loop and replica: a loop's requests to a replica share its Ray calls
_BATCHERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = weakref.WeakKeyDictionary()


def _batcher(handle: Any) -> "_RequestBatcher":
    per_loop = _BATCHERS.setdefault(asyncio.get_running_loop(), {})
    key = handle._actor_id.hex() if hasattr(handle, "_actor_id") else id(handle)
    if key not in per_loop:
        per_loop[key] = _RequestBatcher(handle)
    return per_loop[key]


class _RequestBatcher:
    """Collects one tick's requests to a replica and sends them as one streaming Ray call."""

    def __init__(self, handle: Any):
        self._handle = handle
        self._pending: list[tuple[tuple, asyncio.Future]] = []
        self._sending: set[asyncio.Task] = set()

    def submit(self, request: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:  # runs after every task already scheduled in this tick has submitted
            loop.call_soon(self._flush)
        self._pending.append((request, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        try:
            stream = self._handle.generate_tokens_many.options(num_returns="streaming").remote(
                [request for request, _ in batch])
            async for ref in stream:
                for index, result, error in await ref:
                    future = batch[index][1]
                    if future.done():
                        continue
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(result)
        except BaseException as exc:  # the replica died, or the call could not be sent
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        for _, future in batch:
            if not future.done():
                future.set_exception(RuntimeError("the replica's request stream ended without this request's result"))


class ServesRequestBatches:
    """What a replica actor with ``generate_tokens(prompt_ids, sampling_kwargs, seed)`` adds to
    serve ``GenerateClient``'s coalesced requests."""

    async def generate_tokens_many(self, requests: Sequence[tuple[list[int], dict, int]]):
        """``generate_tokens`` of each request, concurrently (a Ray streaming generator): yields, each
        time requests finish, the list of them as ``(index, Generation, None)`` or ``(index, None,
        exception)``. Requests that finish in the same engine step travel together: one streamed
        item per step costs less than one per request."""
        async def one(index: int, request: tuple) -> tuple:
            try:
                return index, await self.generate_tokens(*request), None
            except Exception as exc:  # that request's own failure: the others go on
                return index, None, exc

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                yield [task.result() for task in done]
        finally:  # the caller went away: its requests stop too
            for task in pending:
                task.cancel()
