"""The prompt dataset: verl-format parquet rows -> chat-templated prompt token ids.

Semantics of the length keys (verl's names and defaults):

- ``data.max_prompt_length`` (default 1024): the longest prompt, in tokens, after
  the chat template has been applied (generation prompt included).
- ``data.filter_overlong_prompts`` (default True): drop prompts longer than
  ``max_prompt_length`` when the dataset is loaded; the count is logged.
- ``data.truncation`` (default ``"error"``): what happens to a prompt that is
  still too long, i.e. only when filtering is off. ``"error"`` raises once for
  all of them, with their count and the first few by file and row; ``"left"`` keeps the last ``max_prompt_length`` tokens,
  ``"right"`` the first ones, ``"middle"`` the first half and the last half.

All prompts are tokenised once, at load time, so length problems show up before
training starts rather than in the middle of a run.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megarl.data.rows import DataFormatError, PromptRow, read_rows
from megarl.logging.progress import Progress

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")


@dataclass(frozen=True)
class PromptItem:
    """One prompt ready for generation and scoring."""

    index: int  # stable sample id: the row's position across all files, counted before filtering
    prompt_ids: list[int]  # chat-templated, possibly truncated token ids: what the model sees
    prompt_text: str  # the chat-templated text before truncation, for logs
    raw_prompt: list[dict[str, str]]  # the chat messages as stored in the file
    data_source: str
    ability: str
    reward_model: dict[str, Any]
    extra_info: dict[str, Any] = field(default_factory=dict)
    agent_name: str | None = None  # the row's agent loop (verl's agent_name column); None: the default

    @property
    def ground_truth(self) -> Any:
        return self.reward_model["ground_truth"]


def truncate_ids(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Shorten ``ids`` to ``max_length`` tokens the way verl does ("left", "right", "middle")."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        tail = max_length - head
        return ids[:head] + (ids[-tail:] if tail else [])
    raise ValueError(f"truncation mode {mode!r} cannot shorten a prompt; use one of 'left', 'right', 'middle'")


def select_rows(rows: list, max_samples: int, shuffle: bool, seed: int | None) -> list:
    """``data.train_max_samples`` / ``val_max_samples`` as verl: the first N rows, or N rows drawn
    without replacement by ``numpy.random.default_rng(data.seed)`` when ``data.shuffle``."""
    if max_samples is None or max_samples <= 0 or max_samples >= len(rows):
        return rows
    if not shuffle:
        return rows[:max_samples]
    import numpy as np

    rng = np.random.default_rng(*(() if seed is None else (seed,)))
    return [rows[i] for i in rng.choice(len(rows), size=max_samples, replace=False).tolist()]


_CHUNK = 4096  # prompts templated and tokenised at a time


def _describe(files) -> str:
    names = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    return str(names[0]) + (f" (+{len(names) - 1} files)" if len(names) > 1 else "")


def _row_tools(chat_tools: Callable[[str | None], list | None] | None, row: PromptRow) -> list | None:
    """The tool schemas of the row's agent loop; a loop name the run does not offer names the row."""
    if chat_tools is None:
        return None
    try:
        return chat_tools(row.agent_name)
    except ValueError as exc:
        if row.agent_name is None:  # the config's default loop: not the data's problem
            raise
        raise DataFormatError(f"{row.source_file}: row {row.row_number}: key 'agent_name': {exc}") from exc


class PromptDataset:
    """Prompts from verl-format parquet files, validated and tokenised with the chat template."""

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        reward_fn_key: str = "data_source",
        need_reward_fn_key: bool = True,
        max_samples: int = -1,
        shuffle: bool = False,
        seed: int | None = None,
        chat_tools: Callable[[str | None], list | None] | None = None,
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not one of {TRUNCATION_MODES}")
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length must be a positive integer, got {max_prompt_length!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat_template, so prompts cannot be formatted; "
                "use a chat/instruct tokenizer or set tokenizer.chat_template before building the dataset"
            )
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts

        rows = read_rows(files, prompt_key=prompt_key, reward_fn_key=reward_fn_key,
                         need_reward_fn_key=need_reward_fn_key)
        if not rows:
            raise DataFormatError(f"no rows in {files!r}: the dataset is empty")
        rows = select_rows(rows, max_samples, shuffle, seed)
        texts, all_ids = [], []
        with Progress(f"preparing {_describe(files)}", total=len(rows), unit="prompts") as progress:
            for start in range(0, len(rows), _CHUNK):  # chunks: progress for datasets of millions of rows
                chunk = []
                for row in rows[start:start + _CHUNK]:
                    kwargs = dict(apply_chat_template_kwargs or {})
                    tools = _row_tools(chat_tools, row)
                    if tools:  # a tool-calling row: the template puts the tool schemas into the prompt
                        kwargs["tools"] = tools
                    chunk.append(tokenizer.apply_chat_template(row.messages, add_generation_prompt=True,
                                                               tokenize=False, **kwargs))
                texts += chunk
                all_ids += tokenizer(chunk, add_special_tokens=False)["input_ids"]
                progress.update(len(chunk))

        self.items: list[PromptItem] = []
        self.num_filtered = 0
        self.num_truncated = 0
        overlong = [(row, len(ids)) for row, ids in zip(rows, all_ids) if len(ids) > max_prompt_length]
        if overlong and not filter_overlong_prompts and truncation == "error":
            raise self._overlong_error(overlong, len(rows))
        for index, (row, text, ids) in enumerate(zip(rows, texts, all_ids)):
            ids = list(ids)
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                self.num_truncated += 1
                ids = truncate_ids(ids, max_prompt_length, truncation)
            self.items.append(self._make_item(index, row, text, ids))

        if self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than data.max_prompt_length=%d tokens (data.filter_overlong_prompts=True)",
                self.num_filtered, len(rows), max_prompt_length,
            )
        if self.num_truncated:
            logger.warning("truncated %d of %d prompts to %d tokens (data.truncation=%r)",
                           self.num_truncated, len(rows), max_prompt_length, truncation)
        if not self.items:
            shortest = min(len(ids) for ids in all_ids)
            raise DataFormatError(
                f"no prompts left in {files!r}: all {len(rows)} prompts are longer than "
                f"data.max_prompt_length={max_prompt_length} tokens (the shortest has {shortest}); "
                "raise data.max_prompt_length or set data.filter_overlong_prompts=False with a data.truncation mode"
            )

    def _overlong_error(self, overlong: list[tuple[PromptRow, int]], total: int) -> DataFormatError:
        """Every prompt over ``max_prompt_length`` at once (data.truncation=error, filtering off), the first few by
        file and row, so that one fix covers them all."""
        shown = "; ".join(f"{row.source_file}: row {row.row_number}: prompt has {n} tokens" for row, n in overlong[:3])
        more = f"; and {len(overlong) - 3} more" if len(overlong) > 3 else ""
        return DataFormatError(
            f"{len(overlong)} of {total} prompts are longer than data.max_prompt_length={self.max_prompt_length} "
            f"tokens (the longest has {max(n for _, n in overlong)}), with data.filter_overlong_prompts=False and "
            f"data.truncation=error: {shown}{more}. Raise data.max_prompt_length, set "
            "data.filter_overlong_prompts=True (drops them, counted), or choose data.truncation=left/right/middle"
        )

    @staticmethod
    def _make_item(index: int, row: PromptRow, text: str, ids: list[int]) -> PromptItem:
        return PromptItem(
            index=index,
            prompt_ids=ids,
            prompt_text=text,
            raw_prompt=row.messages,
            data_source=row.data_source,
            ability=row.ability,
            reward_model=row.reward_model,
            extra_info=row.extra_info,
            agent_name=row.agent_name,
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]
