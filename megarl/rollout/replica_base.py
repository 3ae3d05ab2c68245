"""What every backend's replica does the same way around its engine: the generation gate, request
ids, the weight-sync calls and the version record.

A backend's replica (``vllm/replica.py``, ``hf/replica.py``) subclasses ``GatedReplica`` and gives
its engine's two hooks: ``_abort_running`` (abort every running request: partial rollouts) and
``_after_receive`` (what the engine must do once new weights are in, e.g. drop cached KV blocks).
The rest of the seam (``megarl.rollout.backend.REPLICA_METHODS``) is the backend's own.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from megarl.rollout.gate import GenerationGate
from megarl.weight_sync.endpoints import ReceiverEndpoint

IN_FLIGHT = ("wait", "abort")  # what a sync does to running requests: let them finish, or abort and resume them


class ReplicaLost(RuntimeError):
    """The replica's engine died while its actor lives on (a killed vLLM engine core): the fleet treats
    the replica as lost, as it treats a dead actor (``megarl.rollout.replica_table.is_replica_lost``)."""


def check_finish(index: int, finish_reason: str | None, what: str, allow_abort: bool = False) -> None:
    """A completion must have stopped or hit its length; an abort only where the request is resumed."""
    allowed = ("stop", "length", "abort") if allow_abort else ("stop", "length")
    if finish_reason not in allowed:
        cause = (" (a weight sync aborted it; batch requests are not resumed: generate per request, as the "
                 "agent seam does)" if finish_reason == "abort" else "")
        raise RuntimeError(f"replica {index}: {what} ended with finish_reason={finish_reason!r}{cause}")


def require_one_sample(sampling_kwargs: dict) -> None:
    if sampling_kwargs.get("n", 1) != 1:
        raise ValueError(f"generate_tokens returns one completion; got n={sampling_kwargs['n']}")


def _in_flight(value: str) -> str:
    if value not in IN_FLIGHT:
        raise ValueError(f"in_flight={value!r}: use one of {IN_FLIGHT}")
    return value


def batch_samples(index: int, prompt_index: int, prompt_ids: list[int], segments) -> list:
    """``RolloutSample``s of one prompt of a batch request from ``(sample_index, Segment)`` pairs."""
    from megarl.rollout.sample import RolloutSample

    return [RolloutSample(prompt_index=prompt_index, sample_index=k, prompt_ids=list(prompt_ids),
                          response_ids=g.token_ids, logprobs=g.logprobs, finish_reason=g.finish_reason,
                          stop_string=g.stop_string, response_text=g.text, replica=index) for k, g in segments]


class GatedReplica:
    """The gate, the request counter and the weights' end of the sync (``ReceiverEndpoint``)."""

    def _init_gate(self, index: int, rpc: Callable[..., Any]) -> None:
        self.index = index
        self.weights = ReceiverEndpoint(index, rpc)
        self.gate = GenerationGate()
        self._request_counter = 0

    # hooks of the backend
    def _abort_running(self) -> Any:
        raise NotImplementedError

    def _engine_failure(self) -> str | None:
        """Why the engine cannot serve any more (it died), or None while it can."""
        return None

    async def alive(self) -> bool:
        """The fleet's health check: True, or ``ReplicaLost`` naming why the engine is gone."""
        failure = self._engine_failure()
        if failure:
            raise ReplicaLost(f"replica {self.index}: {failure}")
        return True

    async def _after_receive(self) -> None:
        """Called with the gate closed, after the weights arrived."""

    def _request_id(self, tag: str) -> str:
        self._request_counter += 1
        return f"{tag}-{self.index}-{self._request_counter}"

    async def _gated(self, coroutine_fn, tag: str):
        """Run ``coroutine_fn(request_id)`` as one request that may not be interrupted (batch, scoring)."""
        request_id = self._request_id(tag)
        await self.gate.enter(request_id)
        try:
            self.weights.check_fresh()
            return await coroutine_fn(request_id)
        finally:
            self.gate.leave(request_id)

    async def sync_connect(self, plan, first_rank: int, world_size: int, master_addr: str, master_port: int,
                           transport: str, timeout_s: float, position: int | None = None) -> list[int]:
        """Join the weight-sync world with every engine rank; return their sync ranks. ``position``: this
        replica's place among the world's replicas (default its index; after a replica was lost the
        world holds fewer, or a replacement, and the places move)."""
        return await self.weights.connect(plan, first_rank, world_size, master_addr, master_port, transport,
                                          timeout_s, self.index if position is None else position)

    async def sync_receive(self, version: int, in_flight: str = "wait") -> dict[str, float]:
        """Receive one weight sync (see ``ReceiverEndpoint.receive``).

        The gate closes first: running requests finish on the old weights (``in_flight="wait"``) or
        are aborted and continue after the sync on the new ones (``"abort"``); new ones wait.
        """
        abort = self._abort_running() if _in_flight(in_flight) == "abort" else None
        start = time.perf_counter()
        await self.gate.close(abort)
        waited = time.perf_counter() - start
        try:
            result = await self.weights.receive(version)
            await self._after_receive()
        finally:
            self.gate.open()  # after a failure the requests that wait raise: the weights are stale
        return {**result, "drain_seconds": waited}

    async def weights_version(self) -> int:
        """The version of the weights this replica serves (0: its checkpoint); raises while they are stale."""
        self.weights.check_fresh()
        return self.weights.version

    async def pause(self, in_flight: str = "wait") -> None:
        """Hold generation (before an engine sleeps): running requests finish or are aborted to continue
        after ``resume``; new ones wait."""
        await self.gate.close(self._abort_running() if _in_flight(in_flight) == "abort" else None)

    async def resume(self) -> None:
        self.gate.open()
