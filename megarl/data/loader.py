"""Batches of prompts for the trainer, built from the ``data.*`` config section.

Config keys read (verl's names; defaults in brackets):
``train_files``, ``val_files``, ``prompt_key`` ["prompt"], ``reward_fn_key`` ["data_source"],
``max_prompt_length`` [1024], ``truncation`` ["error"], ``filter_overlong_prompts`` [True],
``apply_chat_template_kwargs`` [{}], ``train_max_samples`` / ``val_max_samples`` [-1: all rows],
``train_batch_size`` (required for training), ``val_batch_size`` [None: the whole
validation set in one batch], ``shuffle`` [True], ``seed`` [1], ``drop_last`` [True].
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


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read a key from a dict, an OmegaConf node or a dataclass-like object."""
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def build_dataset(data_cfg: Any, tokenizer: Any, split: str, need_reward_fn_key: bool = True,
                  chat_tools=None) -> PromptDataset:
    """The train (``split="train"``) or validation (``split="val"``) dataset from ``data.*``.

    ``need_reward_fn_key=False`` (a custom reward function is given) accepts files without the
    ``data.reward_fn_key`` column. ``chat_tools(agent_name)`` gives the tool schemas to render
    into a row's prompt (None: none).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    files = _get(data_cfg, "train_files" if split == "train" else "val_files")
    if files is None:
        raise ValueError(f"data.{split}_files is not set: give a parquet path or a list of paths")
    if not isinstance(files, str) and hasattr(files, "__iter__"):
        files = [str(f) for f in files]  # OmegaConf ListConfig -> plain list
    return PromptDataset(
        files,
        tokenizer,
        prompt_key=_get(data_cfg, "prompt_key", "prompt"),
        max_prompt_length=int(_get(data_cfg, "max_prompt_length", 1024)),
        truncation=_get(data_cfg, "truncation", "error"),
        filter_overlong_prompts=bool(_get(data_cfg, "filter_overlong_prompts", True)),
        apply_chat_template_kwargs=dict(_get(data_cfg, "apply_chat_template_kwargs", {})),
        reward_fn_key=str(_get(data_cfg, "reward_fn_key", "data_source")),
        need_reward_fn_key=need_reward_fn_key,
        max_samples=int(_get(data_cfg, "train_max_samples" if split == "train" else "val_max_samples", -1)),
        shuffle=bool(_get(data_cfg, "shuffle", True)),
        seed=_get(data_cfg, "seed", 1),  # None: 1 as for the batches (resume needs a fixed draw)
        chat_tools=chat_tools,
    )


def build_train_loader(data_cfg: Any, tokenizer: Any, need_reward_fn_key: bool = True,
                       chat_tools=None) -> PromptDataLoader:
    """The training loader: ``data.train_batch_size`` prompts per batch, shuffled per epoch."""
    batch_size = _get(data_cfg, "train_batch_size")
    if batch_size is None:
        raise ValueError("data.train_batch_size is not set")
    return PromptDataLoader(
        build_dataset(data_cfg, tokenizer, "train", need_reward_fn_key, chat_tools),
        int(batch_size),
        shuffle=bool(_get(data_cfg, "shuffle", True)),
        seed=int(_get(data_cfg, "seed", 1)),
        drop_last=bool(_get(data_cfg, "drop_last", True)),
    )
