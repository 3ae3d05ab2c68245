"""Prompt data in verl's parquet format: loading, validation, chat templates, resumable batches."""
from megarl.data.dataset import TRUNCATION_MODES, PromptDataset, PromptItem, truncate_ids
from megarl.data.loader import (
    PromptBatch,
    PromptDataLoader,
    build_dataset,
    build_train_loader,
    collate,
    iterate_in_order,
)
from megarl.data.rows import DataFormatError, PromptRow, read_rows
from megarl.data.sampler import ResumableBatchSampler

__all__ = [
    "TRUNCATION_MODES",
    "DataFormatError",
    "PromptBatch",
    "PromptDataLoader",
    "PromptDataset",
    "PromptItem",
    "PromptRow",
    "ResumableBatchSampler",
    "build_dataset",
    "build_train_loader",
    "collate",
    "iterate_in_order",
    "read_rows",
    "truncate_ids",
]
