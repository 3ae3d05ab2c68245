"""When a replica's engine may run requests, and what a weight sync does to the ones running.

A weight sync must never change the weights under a running request: the tokens after the change
would be sampled by new weights from a KV cache the old weights computed, and stamped with the
wrong version. ``GenerationGate`` closes before a sync and opens after it:

* ``close(abort=None)``: new requests wait at the gate; the running ones finish on the old weights
  (``partial_rollout=False``, and every synchronous step, where nothing runs during a sync);
* ``close(abort=fn)``: the running requests are aborted (``fn(request_ids)``); each keeps its
  tokens and log-probs and ``generate_resumable`` continues it after the sync, on the new weights
  and with a new KV cache (prompt + tokens so far re-read): a partial rollout.

``generate_resumable`` runs one request as segments; every token carries the version of the
weights that sampled it (``versions``). Engine-agnostic (a fake engine in the tests drives it too).
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from megarl.rollout.sample import Generation


class GenerationGate:
    """Open unless someone holds it closed (a sync, a sleeping engine): ``close`` / ``open`` nest."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running: set[str] = set()
        self._holds = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def running(self) -> int:
        return len(self._running)

    async def enter(self, request_id: str) -> None:
        """Wait until the gate is open, then count ``request_id`` as running."""
        while not self._open.is_set():
            await self._open.wait()
        self._running.add(request_id)
        self._idle.clear()

    def leave(self, request_id: str) -> None:
        self._running.discard(request_id)
        if not self._running:
            self._idle.set()

    async def close(self, abort: Callable[[list[str]], Awaitable[None]] | None = None) -> None:
        """Stop new requests; abort the running ones (``abort``) or let them finish; return when none runs."""
        self._holds += 1
        self._open.clear()
        if abort is not None and self._running:
            await abort(sorted(self._running))
        await self._idle.wait()

    def open(self) -> None:
        """Release one ``close``; requests run again when no one holds the gate."""
        self._holds = max(0, self._holds - 1)
        if self._holds == 0:
            self._open.set()


@dataclass
class Segment:
    """What the engine returned for one segment of a request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    stop_string: str | None
    text: str


RunSegment = Callable[[str, list[int], int, int], Awaitable[Segment]]  # (request_id, prompt, max_tokens, seed)
_ids = itertools.count()


def segment_seed(seed: int, segment: int) -> int:
    """The seed of a request's ``segment``-th part: the request's own for the first."""
    if segment == 0:
        return seed
    digest = hashlib.sha256(f"megarl-resume/{seed}/{segment}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


async def generate_resumable(gate: GenerationGate, run_segment: RunSegment, prompt_ids: Sequence[int],
                             max_tokens: int, seed: int, version: Callable[[], int], tag: str,
                             detokenize: Callable[[list[int]], str] | None = None,
                             resume: Generation | None = None) -> Generation:
    """One completion of ``prompt_ids``, continued across weight syncs that abort it.

    Each segment enters the gate (so it starts on the weights of one version, read at its start),
    asks for the tokens still allowed, and appends what it got. A segment that ends other than by
    ``abort`` ends the request. The text of a request that ran in several segments is
    ``detokenize(all tokens)`` (a stop string that straddles a sync is not seen). ``resume``: the
    tokens of an aborted first segment that ran elsewhere (a group request); they are continued
    from segment 1 on.
    """
    prompt = [int(t) for t in prompt_ids]
    tokens = list(resume.token_ids) if resume else []
    logprobs = list(resume.logprobs) if resume else []
    versions = list(resume.versions) if resume else []
    first = 1 if resume else 0
    finish, stop, text = "length", None, None
    for segment in itertools.count(first):
        if len(tokens) >= max_tokens:
            break
        request_id = f"{tag}-{next(_ids)}"
        await gate.enter(request_id)
        try:
            current = version()
            part = await run_segment(request_id, prompt + tokens, max_tokens - len(tokens),
                                     segment_seed(seed, segment))
        finally:
            gate.leave(request_id)
        tokens += part.token_ids
        logprobs += part.logprobs
        versions += [current] * len(part.token_ids)
        if part.finish_reason != "abort":
            finish, stop, text = part.finish_reason, part.stop_string, part.text
            break
    if segment > 0 or text is None:
        text = detokenize(tokens) if detokenize is not None else ""
    return Generation(token_ids=tokens, logprobs=logprobs, finish_reason=finish, stop_string=stop, text=text,
                      versions=versions)


RunGroup = Callable[[str, list[int], int, int], Awaitable[list[Segment]]]  # (request_id, prompt, max_tokens, seed)


async def generate_group_resumable(gate: GenerationGate, run_group: RunGroup, run_segment: RunSegment,
                                   prompt_ids: Sequence[int], max_tokens: int, seed: int,
                                   version: Callable[[], int], tag: str,
                                   detokenize: Callable[[list[int]], str] | None = None) -> list[Generation]:
    """The n completions of one prompt as one engine request (``run_group``: the k-th completion is
    sampled with seed ``seed + k``, as vLLM seeds the samples of one request); a completion a sync
    aborts continues alone (``generate_resumable`` from segment 1 on, seed ``seed + k``), so every
    completion equals the one its own single request would give."""
    request_id = f"{tag}-{next(_ids)}"
    await gate.enter(request_id)
    try:
        current = version()
        parts = await run_group(request_id, [int(t) for t in prompt_ids], max_tokens, seed)
    finally:
        gate.leave(request_id)

    async def finish(k: int, part: Segment) -> Generation:
        done = Generation(token_ids=part.token_ids, logprobs=part.logprobs, finish_reason=part.finish_reason,
                          stop_string=part.stop_string, text=part.text, versions=[current] * len(part.token_ids))
        if part.finish_reason != "abort":
            return done
        return await generate_resumable(gate, run_segment, prompt_ids, max_tokens, seed + k, version, f"{tag}.{k}",
                                        detokenize, resume=done)

    return list(await asyncio.gather(*[finish(k, part) for k, part in enumerate(parts)]))
