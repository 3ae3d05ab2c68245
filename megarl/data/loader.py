"""Batches of prompts for the trainer: a resumable loader over a ``PromptDataset``.

``megarl.settings.data`` builds both from the ``data.*`` config section.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from megarl.data.dataset import PromptDataset, PromptItem
from megarl.data.sampler import ResumableBatchSampler


@dataclass(frozen=True)
class PromptBatch:
    """A batch of prompts and where it came from (epoch, batch number within that epoch)."""

    items: list[PromptItem]
    epoch: int
    position: int

    def __len__(self) -> int:
        return len(self.items)

    def columns(self) -> dict[str, list[Any]]:
        """Parallel lists, one per field: what the rollout and the reward manager take."""
        return collate(self.items)


def collate(items: list[PromptItem]) -> dict[str, list[Any]]:
    """Turn a list of items into a dict of parallel lists."""
    return {
        "index": [it.index for it in items],
        "prompt_ids": [it.prompt_ids for it in items],
        "prompt_text": [it.prompt_text for it in items],
        "raw_prompt": [it.raw_prompt for it in items],
        "data_source": [it.data_source for it in items],
        "ability": [it.ability for it in items],
        "ground_truth": [it.ground_truth for it in items],
        "reward_model": [it.reward_model for it in items],
        "extra_info": [it.extra_info for it in items],
        "agent_name": [it.agent_name for it in items],
        "images": [it.images for it in items],
    }


class PromptDataLoader:
    """Training batches of ``batch_size`` prompts from a resumable sampler."""

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 1, drop_last: bool = True):
        self.dataset = dataset
        self.sampler = ResumableBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.sampler)

    def next_batch(self) -> PromptBatch:
        indices = self.sampler.next_batch()
        return PromptBatch([self.dataset[i] for i in indices], self.sampler.epoch, self.sampler.position - 1)

    def next_positions(self) -> list[int]:
        """The dataset positions of the next batch (``item`` reads them): for a consumer that keeps
        positions in its own state, as the asynchronous producer does."""
        return self.sampler.next_batch()

    def item(self, position: int) -> PromptItem:
        return self.dataset[position]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def iterate_in_order(dataset: PromptDataset, batch_size: int | None = None) -> Iterator[list[PromptItem]]:
    """All items once, in file order, in batches (validation). ``None`` gives a single batch."""
    size = batch_size or len(dataset)
    for start in range(0, len(dataset), size):
        yield [dataset[i] for i in range(start, min(start + size, len(dataset)))]
