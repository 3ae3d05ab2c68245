"""The rollout producer of asynchronous training: prompt groups generated ahead of the trainer.

A background thread with its own asyncio loop. It draws prompts from the training loader in order,
numbers them (``key``: prompt ``key % W`` of step ``key // W + 1``, the synchronous loop's seeds and
replica, so a group samples what the synchronous step would at the same weights), starts a group
whenever ``SampleBuffer.admit`` allows (the staleness bound), runs its ``rollout.n`` agent loops on
the fleet through the agent seam, builds its step data and hands it to the buffer. Rewards are not
computed here: the trainer scores what it takes, as in the synchronous loop.

State for a checkpoint (``state_dict``): the prompts drawn but not yet trained (admitted, running or
finished, and drawn but not admitted), by key and dataset position, the loader position after them
and the next key. A resumed producer starts those prompts again first, at the resumed weights,
then continues with the loader: no prompt is skipped or trained twice, and the bound holds from
the first group on (the buffer's counters restart at the resumed step).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from megarl.trainer.rollout_batch import build_step_data
from megarl.trainer.asynchronous.sample_buffer import SampleBuffer

logger = logging.getLogger(__name__)


class RolloutProducer:
    def __init__(self, rollout, loader, buffer: SampleBuffer, *, n: int, batch_size: int, pad_id: int,
                 response_length: int, processor=None):
        from megarl.data import collate

        self.rollout, self.loader, self.buffer = rollout, loader, buffer
        self.n, self.batch_size, self.pad_id, self.response_length = n, batch_size, pad_id, response_length
        self.processor = processor  # a vision-language model's (the groups' pixel values), else None
        self.collate = collate
        self.next_key = 0
        self.pending: list[tuple[int, int]] = []  # (key, dataset position), drawn and not yet admitted
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        buffer.on_change = self.wake

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> None:
        if self._thread is None:
            ready = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(ready,), name="rollout-producer", daemon=True)
            self._thread.start()
            ready.wait()

    def wake(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed in between
                pass

    def stop(self) -> None:
        self._stopping = True
        self.buffer.close()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    # ------------------------------------------------------------------ the loop (its own thread)
    def _run(self, ready: threading.Event) -> None:
        async def main() -> None:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            tasks: set[asyncio.Task] = set()
            try:
                while not self._stopping:
                    self._wake.clear()
                    while (group := self._admit_next()) is not None:
                        task = asyncio.ensure_future(self._run_group(group))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    await self._wake.wait()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            self.buffer.fail(exc)
            ready.set()

    def _admit_next(self):
        """Admit the next prompt if the bound allows (under the buffer's lock, so a checkpoint sees
        the loader, the pending prompts and the groups in one consistent state)."""
        with self.buffer.lock:
            if self.buffer.capacity() < 1:
                return None
            if not self.pending:
                self.pending = [(self.next_key + i, position) for i, position in enumerate(self.loader.next_positions())]
                self.next_key += len(self.pending)
            key, position = self.pending[0]
            group = self.buffer.admit(key, self.loader.item(position), position)
            if group is not None:
                self.pending.pop(0)
            return group

    async def _run_group(self, group) -> None:
        try:
            step, index = group.key // self.batch_size + 1, group.key % self.batch_size
            cols = self.collate([group.item])
            replica = self.rollout.fleet.replica_for(index, self.batch_size)
            trajectories = await self.rollout.agenerate(cols, step=step, prompt_index=index, replica=replica, n=self.n)
            data = build_step_data(cols, trajectories, [0] * len(trajectories), [f"{step}:{index}"] * len(trajectories),
                                   self.pad_id, self.response_length, processor=self.processor)
            unknown = data["first_version"] < 0  # a loop that records no versions: the group started at admission
            data["first_version"][unknown] = group.version
            self.buffer.finish(group.key, data, trajectories)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the trainer raises it at its next take
            logger.error("rollout of prompt %d failed: %s", group.key, exc)
            self.buffer.fail(exc)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        with self.buffer.lock:
            return {"untrained": self.buffer.untrained() + list(self.pending), "next_key": self.next_key,
                    "loader": self.loader.state_dict(), "dropped": self.buffer.dropped,
                    "filtered": self.buffer.filtered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("load the producer's state before it starts")
        with self.buffer.lock:
            self.loader.load_state_dict(state["loader"])
            self.pending = [(int(k), int(p)) for k, p in sorted(state["untrained"])]
            self.next_key = int(state["next_key"])
            self.buffer.dropped, self.buffer.filtered = int(state["dropped"]), int(state["filtered"])
