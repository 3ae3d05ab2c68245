"""Continuous batching for the hf backend: the requests that wait join the running batch every step.

The replica's coroutines (``generate``, ``generate_tokens``, ``score``) run concurrently on the
actor's event loop. Each generation request becomes ``n`` sequences (``sequence.Sequence``) in
the waiting queue and awaits them; one loop task (``_loop``) runs the engine a step at a time:
before each step it drops the sequences that stopped or were aborted and admits waiting ones (up
to ``max_num_seqs`` running, and ``max_num_batched_tokens`` tokens per step: one per running
sequence plus the prompts of the admitted ones; a step admits at least one sequence when
nothing else runs), then runs ``HFEngine.step`` on the engine thread and hands each sequence its
token. Every use of the model (steps, scoring, loading synced weights) runs on that one thread,
one at a time, so the event loop stays free to accept requests while the model computes.

``abort(keys)`` (a weight sync with ``in_flight="abort"``, or ``pause``): waiting sequences of
those requests end at once with no new tokens, running ones at the end of the current step with
the tokens they have; both finish as "abort" (the replica continues them after the sync).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence as Seq

from megarl.rollout.hf.engine import HFEngine
from megarl.rollout.hf.sampler import RowSampling
from megarl.rollout.hf.sequence import Sequence

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, engine: HFEngine, tokenizer: Any, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_id: int | None, extra_eos_ids: frozenset[int],
                 log_stats: bool = False):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_model_len, self.max_num_seqs, self.max_num_batched_tokens = max_model_len, max_num_seqs, max_num_batched_tokens
        self.eos_token_id, self.extra_eos_ids = eos_token_id, extra_eos_ids
        self.log_stats = log_stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._work: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stats = {"since": time.perf_counter(), "tokens": 0, "steps": 0}

    async def on_engine(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the engine thread (after the step in progress, if any)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def generate(self, key: str, prompt: list[int], settings: RowSampling, seed: int) -> list[Sequence]:
        """``settings.n`` completions of ``prompt``: sample k is seeded with ``seed + k``; in sample order."""
        sequences = [Sequence(key, k, prompt, settings, seed + k, self.eos_token_id, self.extra_eos_ids, self.tokenizer)
                     for k in range(settings.n)]
        self.waiting.extend(sequences)
        self._wake()
        try:
            return list(await asyncio.gather(*(s.done for s in sequences)))
        except asyncio.CancelledError:  # the caller is gone: its sequences stop at the next step
            await self.abort([key])
            raise

    async def abort(self, keys: Seq[str]) -> None:
        keys = set(keys)
        for sequence in [s for s in self.waiting if s.key in keys]:
            self.waiting.remove(sequence)
            sequence.finish("abort")
        for sequence in self.running:
            if sequence.key in keys and not sequence.finished:
                sequence.abort_requested = True

    def _wake(self) -> None:
        if self._task is None or self._task.done():
            self._work = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._work.set()

    def _admit(self, running: int) -> list[Sequence]:
        admitted: list[Sequence] = []
        prompts: set[tuple[int, ...]] = set()
        budget = self.max_num_batched_tokens - running
        while self.waiting and running + len(admitted) < self.max_num_seqs:
            prompt = tuple(self.waiting[0].prompt)
            cost = 0 if prompt in prompts else len(prompt)
            if cost > budget and (admitted or running):
                break
            budget -= cost
            prompts.add(prompt)
            admitted.append(self.waiting.popleft())
        return admitted

    async def _loop(self) -> None:
        while True:
            keep = [i for i, s in enumerate(self.running) if not s.finished]
            admitted = self._admit(len(keep))
            if not keep and not admitted:
                self.running = []
                await self.on_engine(self.engine.reset)
                if not self.waiting:  # (checked after the await: a request may have come meanwhile)
                    self._work.clear()
                    await self._work.wait()
                continue
            batch = self.running = [self.running[i] for i in keep] + admitted  # visible to abort() during the step
            try:
                tokens, logprobs = await self.on_engine(
                    self.engine.step, keep, [s.prompt for s in admitted], [s.settings for s in batch],
                    [s.generator for s in batch])
                for sequence, token, logprob in zip(batch, tokens, logprobs):
                    sequence.append(token, logprob, self.max_model_len)
                    if sequence.finished:
                        sequence.finish()
                    elif sequence.abort_requested:
                        sequence.finish("abort")
            except Exception as exc:  # noqa: BLE001 - every request of the batch gets the error
                logger.exception("hf engine step failed")
                for sequence in batch:
                    sequence.finish(error=exc)
                self.running = []
                await self.on_engine(self.engine.reset)
                continue
            self._record(len(batch))

    def _record(self, tokens: int) -> None:
        stats = self._stats
        stats["tokens"] += tokens
        stats["steps"] += 1
        elapsed = time.perf_counter() - stats["since"]
        if self.log_stats and elapsed >= 10:
            logger.info("hf engine: %.0f tokens/s over %d steps; running %d, waiting %d", stats["tokens"] / elapsed,
                        stats["steps"], len(self.running), len(self.waiting))
            self._stats = {"since": time.perf_counter(), "tokens": 0, "steps": 0}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        for sequence in [*self.waiting, *self.running]:
            sequence.finish(error=RuntimeError("the hf engine was closed"))
        self.waiting.clear()
        self.running = []
        self.executor.shutdown(wait=True)
