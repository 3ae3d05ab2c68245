"""Prompt data in verl's parquet format: loading, validation, chat templates, images, resumable batches."""
from megarl.data.dataset import TRUNCATION_MODES, PromptDataset, PromptItem, truncate_ids
from megarl.data.image_prompts import collapse_image_tokens
from megarl.data.images import BadImage, decode_image, pixel_inputs, resize_image
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
    "BadImage",
    "UNKNOWN_SOURCE",
    "DataFormatError",
    "PromptBatch",
    "PromptDataLoader",
    "PromptDataset",
    "PromptItem",
    "PromptRow",
    "ResumableBatchSampler",
    "collapse_image_tokens",
    "collate",
    "column_problems",
    "decode_image",
    "iterate_in_order",
    "pixel_inputs",
    "read_rows",
    "resize_image",
    "truncate_ids",
]
