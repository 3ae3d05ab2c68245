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
training starts rather than in the middle of a run. Rows with images (a vision-language model's
processor given) are decoded and resized then too, and their image tokens count in the length:
a truncation that would cut an image's tokens skips the row, counted with its reason.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megarl.data.image_prompts import SkippedRows, expand_image_tokens, image_prompt, image_spans
from megarl.data.images import BadImage, resize_rule
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
    raw_prompt: list[dict[str, Any]]  # the chat messages as stored; a row with images: with image parts (below)
    data_source: str
    ability: str
    reward_model: dict[str, Any]
    extra_info: dict[str, Any] = field(default_factory=dict)
    agent_name: str | None = None  # the row's agent loop (verl's agent_name column); None: the default
    # the images, resized by the model's image processor, in the order of the {"type": "image"} parts of
    # raw_prompt and of the image-token runs of prompt_ids (megarl.data.images.pixel_inputs: their pixel values)
    images: tuple = ()

    @property
    def ground_truth(self) -> Any:
        return self.reward_model["ground_truth"]


def kept_ranges(length: int, max_length: int, mode: str) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of a ``length``-token prompt that truncation to ``max_length`` keeps."""
    if length <= max_length:
        return [(0, length)]
    if mode == "left":
        return [(length - max_length, length)]
    if mode == "right":
        return [(0, max_length)]
    if mode == "middle":
        head = max_length // 2
        return [(0, head), (length - (max_length - head), length)]
    raise ValueError(f"truncation mode {mode!r} cannot shorten a prompt; use one of 'left', 'right', 'middle'")


def truncate_ids(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Shorten ``ids`` to ``max_length`` tokens the way verl does ("left", "right", "middle")."""
    return [token for start, end in kept_ranges(len(ids), max_length, mode) for token in ids[start:end]]


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


def _refuse_images(rows: list[PromptRow], image_key: str) -> None:
    """Rows with images and no processor: the model is a text model, which cannot see them."""
    found = [row for row in rows if row.images]
    if found:
        shown = "; ".join(f"{row.source_file}: row {row.row_number}" for row in found[:3])
        raise DataFormatError(
            f"{len(found)} of {len(rows)} rows have images (column {image_key!r}, data.image_key; {shown}) but the "
            "model is not a vision-language model (its config.json has no vision_config, so there is no image "
            "processor): use a vision-language model, or drop the images column")


@dataclass(frozen=True)
class _Prepared:
    """One row templated and tokenised (image tokens expanded), before the length rules."""

    index: int
    row: PromptRow
    messages: list[dict[str, Any]]
    text: str
    ids: list[int]
    images: tuple = ()


class _Templating:
    """Chat template and tokeniser over all rows, in chunks with progress; rows with images through the processor."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any], chat_tools, processor: Any):
        self.tokenizer, self.kwargs, self.chat_tools, self.processor = tokenizer, kwargs, chat_tools, processor
        self.rule = resize_rule(processor) if processor is not None else None
        self.image_token_id = (tokenizer.convert_tokens_to_ids(processor.image_token)
                               if processor is not None else None)

    def all(self, rows: list[PromptRow], title: str, skipped: SkippedRows) -> list[_Prepared]:
        prepared: list[_Prepared] = []
        numbered = list(enumerate(rows))  # the index: the row's position before any is skipped or filtered
        with Progress(title, total=len(rows), unit="prompts") as progress:
            for start in range(0, len(rows), _CHUNK):  # chunks: progress for datasets of millions of rows
                chunk = numbered[start:start + _CHUNK]
                prepared += self._chunk(chunk, skipped)
                progress.update(len(chunk))
        return prepared

    def _chunk(self, chunk: list[tuple[int, PromptRow]], skipped: SkippedRows) -> list[_Prepared]:
        rendered = []
        for index, row in chunk:
            messages, images, tokens = row.messages, (), ()
            if self.processor is not None:  # text rows too: an <image> without its image is a bad row
                try:
                    vision = image_prompt(row.messages, row.images, self.processor, self.rule)
                except BadImage as exc:
                    skipped.add(row.source_file, row.row_number, exc)
                    continue
                messages, images, tokens = vision.messages, vision.images, vision.tokens
            kwargs = dict(self.kwargs)
            tools = _row_tools(self.chat_tools, row)
            if tools:  # a tool-calling row: the template puts the tool schemas into the prompt
                kwargs["tools"] = tools
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
            rendered.append((index, row, messages, text, images, tokens))
        all_ids = self.tokenizer([r[3] for r in rendered], add_special_tokens=False)["input_ids"] if rendered else []
        out = []
        for (index, row, messages, text, images, tokens), ids in zip(rendered, all_ids):
            if self.image_token_id is not None:  # text rows too: the image token in their text would want an image
                try:
                    ids = expand_image_tokens(ids, self.image_token_id, tokens)
                except BadImage as exc:
                    skipped.add(row.source_file, row.row_number, exc)
                    continue
            out.append(_Prepared(index, row, messages, text, list(ids), images))
        return out


def _cuts_an_image(p: _Prepared, max_length: int, mode: str, image_token_id: int | None) -> bool:
    """Whether truncating ``p`` would drop or split an image's tokens (its markers included)."""
    if not p.images:
        return False
    kept = kept_ranges(len(p.ids), max_length, mode)
    return any(not any(start <= a and b <= end for start, end in kept) for a, b in image_spans(p.ids, image_token_id))


class PromptDataset:
    """Prompts from verl-format parquet files, validated and tokenised with the chat template.

    With ``processor`` (the model's ``AutoProcessor``: a vision-language model), rows with images
    (column ``image_key``) get their ``<image>`` placeholders rendered and their image tokens
    counted (``megarl.data.image_prompts``), and their items carry the resized images. Without it,
    a row with images is refused: a text model cannot see them.
    """

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
        processor: Any = None,
        image_key: str = "images",
        video_key: str = "videos",
        audio_key: str = "audios",
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
        self.skipped = SkippedRows()  # rows whose images cannot be used (vision-language data)

        rows = read_rows(files, prompt_key=prompt_key, reward_fn_key=reward_fn_key,
                         need_reward_fn_key=need_reward_fn_key, image_key=image_key,
                         refused_media={"data.video_key": video_key, "data.audio_key": audio_key})
        if not rows:
            raise DataFormatError(f"no rows in {files!r}: the dataset is empty")
        rows = select_rows(rows, max_samples, shuffle, seed)
        if processor is None:
            _refuse_images(rows, image_key)
        templated = _Templating(tokenizer, dict(apply_chat_template_kwargs or {}), chat_tools, processor)
        prepared = templated.all(rows, f"preparing {_describe(files)}", self.skipped)
        if not prepared:
            raise DataFormatError(f"no usable rows in {files!r}: {self.skipped.summary(len(rows))}")

        self.num_filtered = 0
        self.num_truncated = 0
        self.items: list[PromptItem] = self._length_rules(prepared, templated.image_token_id)
        self._report(files, len(rows), prepared)

    def _length_rules(self, prepared: list[_Prepared], image_token_id: int | None) -> list[PromptItem]:
        """``data.max_prompt_length`` over the prepared rows: filtered, truncated (never through an image) or refused."""
        limit, truncation = self.max_prompt_length, self.truncation
        overlong = [(p.row, len(p.ids)) for p in prepared if len(p.ids) > limit]
        if overlong and not self.filter_overlong_prompts and truncation == "error":
            raise self._overlong_error(overlong, len(prepared))
        items = []
        for p in prepared:
            ids = p.ids
            if len(ids) > limit:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if _cuts_an_image(p, limit, truncation, image_token_id):
                    self.skipped.add(p.row.source_file, p.row.row_number, BadImage(
                        "truncation would cut an image's tokens",
                        f"{len(ids)} tokens, data.truncation={truncation}, data.max_prompt_length={limit}"))
                    continue
                self.num_truncated += 1
                ids = truncate_ids(ids, limit, truncation)
            items.append(self._make_item(p, ids))
        return items

    def _report(self, files, total: int, prepared: list[_Prepared]) -> None:
        """The warnings for the rows left out; an error when none is left."""
        limit = self.max_prompt_length
        if self.skipped:
            logger.warning("%s", self.skipped.summary(total))
        if self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than data.max_prompt_length=%d tokens (data.filter_overlong_prompts=True)",
                self.num_filtered, len(prepared), limit,
            )
        if self.num_truncated:
            logger.warning("truncated %d of %d prompts to %d tokens (data.truncation=%r)",
                           self.num_truncated, len(prepared), limit, self.truncation)
        if self.items:
            return
        if not self.num_filtered:  # every row left would be cut through an image
            raise DataFormatError(f"no usable rows in {files!r}: {self.skipped.summary(total)}; raise "
                                  "data.max_prompt_length or set data.filter_overlong_prompts=True")
        shortest = min(len(p.ids) for p in prepared)
        raise DataFormatError(
            f"no prompts left in {files!r}: all {len(prepared)} prompts are longer than "
            f"data.max_prompt_length={limit} tokens (the shortest has {shortest}); "
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
    def _make_item(p: "_Prepared", ids: list[int]) -> PromptItem:
        row = p.row
        return PromptItem(
            index=p.index,
            prompt_ids=ids,
            prompt_text=p.text,
            raw_prompt=p.messages,
            data_source=row.data_source,
            ability=row.ability,
            reward_model=row.reward_model,
            extra_info=row.extra_info,
            agent_name=row.agent_name,
            images=p.images,
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]
