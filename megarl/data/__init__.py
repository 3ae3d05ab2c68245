"""Prompt data in verl's parquet format: loading, validation, chat templates, resumable batches."""
from megarl.data.dataset import TRUNCATION_MODES, PromptDataset, PromptItem, truncate_ids
from megarl.data.loader import (
    PromptBatch,
    PromptDataLoader,
    collate,
    iterate_in_order,
)
from megarl.data.rows import UNKNOWN_SOURCE, DataFormatError, PromptRow, column_problems, read_rows
from megarl.data.sampler import ResumableBatchSampler

__all__ = [
    "TRUNCATION_MODES",
    "UNKNOWN_SOURCE",
    "DataFormatError",
    "PromptBatch",
    "PromptDataLoader",
    "PromptDataset",
    "PromptItem",
    "PromptRow",
    "ResumableBatchSampler",
    "collate",
    "column_problems",
    "iterate_in_order",
    "read_rows",
    "truncate_ids",
]
