"""Asynchronous training: the trainer takes its batches from a producer that runs ahead of it.

``async_training.mode``:

* ``sync``: the controller's own loop (``RLTrainer.collect_batch``): generate, train, sync, repeat.
* ``one_step_off``: while the trainer trains on batch k the fleet generates batch k+1 with the
  weights before that update; weights change at batch boundaries (a sync waits for running
  generations), and batch k trains exactly the prompts of loader batch k. Staleness: 1 version.
* ``fully_async``: groups stream in as they finish; at most ``staleness_threshold`` train batches of
  groups run ahead of the trainer, no group trains more than ``ceil(staleness_threshold)`` versions
  after its first token (``staleness.py``), a step takes the finished groups with the earliest
  deadlines (``max_off_policy_strategy``: ``wait`` for late old groups, or ``drop`` them), weights
  are published every ``trigger_parameter_sync_step`` steps, and with ``partial_rollout`` a sync
  aborts running generations, which continue on the new weights.

``AsyncBatches`` is what ``RLTrainer`` calls in these modes (``take``, ``sync_due``, ``published``,
``discard``); the producer thread (``rollout_producer.py``) and the buffer (``sample_buffer.py``)
do the work. With staleness 0 and one step per sync, every step trains the groups started after the
last sync, in prompt order: the synchronous loop's batches, token for token.
"""
from __future__ import annotations

from typing import Any

from megarl.trainer.rollout_batch import StepData, concat_step_data
from megarl.trainer.asynchronous.producer import RolloutProducer
from megarl.trainer.asynchronous.sample_buffer import SampleBuffer
from megarl.settings.trainer import AsyncSettings

MODES = ("sync", "one_step_off", "fully_async")


class AsyncBatches:
    """The batch source of the asynchronous modes, over ``rollout`` (the agent seam) and ``loader``."""

    def __init__(self, settings: AsyncSettings, rollout, loader, weight_sync, *, n: int, pad_id: int,
                 response_length: int, processor=None):
        self.settings, self.weight_sync = settings, weight_sync
        self.buffer = SampleBuffer(settings.bound, timeout_s=settings.timeout_s)
        self.producer = RolloutProducer(rollout, loader, self.buffer, n=n, batch_size=settings.bound.batch_groups,
                                        pad_id=pad_id, response_length=response_length, processor=processor)
        self.started_at: int | None = None  # the first step this run trains

    @property
    def in_flight(self) -> str:
        return self.settings.in_flight

    def take(self, step: int, count: int | None = None) -> tuple[StepData, list]:
        """Step ``step``'s groups (``count``, default the train batch), merged, with their trajectories."""
        if self.started_at is None:
            self.started_at = step
            self.buffer.start(self.weight_sync.version, step - 1)
            self.producer.start()
        groups = self.buffer.take(count or self.settings.bound.batch_groups, step - 1)
        data = concat_step_data([g.data for g in groups])
        return data, [t for g in groups for t in g.trajectories]

    def discard(self, count: int) -> None:
        """``count`` taken groups were not trained (DAPO's filter): their slots go back to the producer."""
        self.buffer.discard(count)

    def window(self, step: int) -> int:
        """The version the weights of step ``step`` start from (for the staleness metrics)."""
        return self.buffer.window(step - 1)

    def sync_due(self, step: int) -> bool:
        """Step ``step`` closes a window: publish the weights after it."""
        first = step if self.started_at is None else self.started_at
        return (step - first + 1) % self.settings.bound.sync_every == 0

    def published(self, version: int) -> None:
        self.buffer.published(version)

    def metrics(self) -> dict[str, float]:
        counts = self.buffer.counts()
        return {"training/off_policy/running_groups": float(counts["running"]),
                "training/off_policy/finished_groups": float(counts["finished"]),
                "training/off_policy/dropped_groups": float(counts["dropped"]),
                "training/off_policy/filtered_groups": float(counts["filtered"]),
                "training/off_policy/most_ahead_groups": float(counts["most_ahead"]),
                "training/off_policy/trainer_wait_s": self.buffer.trainer_wait_s}

    def state_dict(self) -> dict[str, Any]:
        return self.producer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.producer.load_state_dict(state)

    def close(self) -> None:
        self.producer.stop()
