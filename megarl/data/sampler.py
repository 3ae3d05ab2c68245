"""A batch sampler whose position can be saved and restored exactly.

The order of epoch ``e`` is a permutation drawn from ``numpy.random.default_rng([seed, e])``
(or the identity when ``shuffle`` is off), so it depends only on the seed and
the epoch. The state is just ``(epoch, position)``: the epoch being read and how
many batches of it were already handed out. A run resumed from ``state_dict()``
therefore continues with exactly the next batch: nothing replayed, nothing skipped.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class ResumableBatchSampler:
    """Hands out batches of dataset indices, epoch after epoch, and can resume mid-epoch."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 1, drop_last: bool = True):
        if num_samples <= 0:
            raise ValueError(f"cannot sample batches from an empty dataset (num_samples={num_samples})")
        if batch_size <= 0:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        if drop_last and num_samples < batch_size:
            raise ValueError(
                f"the dataset has {num_samples} prompts, fewer than one batch of {batch_size} "
                "(data.train_batch_size); lower the batch size or add data"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of one epoch: a function of (seed, epoch) only."""
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._order = np.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[int]:
        """The next batch of indices; moves to the next epoch when this one is used up."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        batch = self.epoch_order(self.epoch)[start:start + self.batch_size]
        self.position += 1
        return [int(i) for i in batch]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            # kept to check that a resumed run reads the same data in the same way
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "batch_size", "shuffle", "seed", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data sampler: the checkpoint has {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; resume with the same data files and data.* settings"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
