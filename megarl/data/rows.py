"""Read verl-format parquet files and validate every row.

verl's RL datasets are parquet files with one prompt per row:

- ``data_source`` (str): selects the reward function, e.g. ``"openai/gsm8k"``; the column is
  ``data.reward_fn_key``. It may be absent when a custom reward function is given (which needs
  no rule to be picked): the rows then carry ``"unknown"``, as verl's metrics call them;
- ``prompt`` (list of ``{"role": str, "content": str}``): the chat messages
  (the column name is ``data.prompt_key``);
- ``ability`` (str, optional here): a free-form tag such as ``"math"``;
- ``reward_model`` (struct ``{style, ground_truth}``): ``ground_truth`` is what
  the reward function compares against;
- ``extra_info`` (struct, optional here): anything else, e.g. ``{split, index}``;
  it is passed to the reward function unchanged (multi-turn data keeps verl's
  ``tools_kwargs`` here: per tool, ``create_kwargs`` and friends);
- ``agent_name`` (str, optional): the agent loop of the row (verl's column), e.g.
  ``tool_agent``; unset rows use ``actor_rollout_ref.rollout.agent.default_agent_loop``;
- ``images`` (list, optional; the column is ``data.image_key``): the row's images, one per
  ``<image>`` placeholder in its messages (entries: ``megarl.data.images``). Videos and audio
  (``data.video_key``, ``data.audio_key``) are refused: megarl does not train on them yet.

Every row is checked when the files are loaded, so a bad row fails the run
before any model starts, with an error that names the file, the row and the key (text that is
not valid UTF-8 too: ``megarl.data.utf8``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import pyarrow.parquet as pq

from megarl.data.utf8 import InvalidUtf8, to_python_rows


class DataFormatError(ValueError):
    """A dataset file or row does not follow verl's parquet format."""


UNKNOWN_SOURCE = "unknown"  # the data source of rows without a data.reward_fn_key column


def column_problems(path: str, columns: Sequence[str], prompt_key: str = "prompt",
                    reward_fn_key: str = "data_source", need_reward_fn_key: bool = True) -> list[str]:
    """What a file with these columns lacks; ``need_reward_fn_key`` is False when a custom reward is given."""
    required = [prompt_key, "reward_model"] + ([reward_fn_key] if need_reward_fn_key else [])
    missing = [name for name in required if name not in columns]
    if not missing:
        return []
    hint = (f" ({reward_fn_key!r} picks the rule reward: set custom_reward_function.path, or data.reward_fn_key to "
            "the column that names the data source)") if reward_fn_key in missing else ""
    return [f"{path}: missing column(s) {missing}; columns present: {list(columns)}. verl's format needs "
            f"{prompt_key} (data.prompt_key) and reward_model{hint}"]


@dataclass(frozen=True)
class PromptRow:
    """One validated dataset row, before tokenisation."""

    messages: list[dict[str, str]]
    data_source: str
    ability: str
    reward_model: dict[str, Any]
    extra_info: dict[str, Any]
    source_file: str
    row_number: int  # 0-based row within ``source_file``
    agent_name: str | None = None
    images: tuple = ()  # the row's image entries as stored (data.image_key), decoded by the dataset

    @property
    def ground_truth(self) -> Any:
        return self.reward_model["ground_truth"]


def normalize_file_list(files: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Accept one path or a list of paths (verl allows both) and expand ``~``."""
    if files is None:
        raise DataFormatError("no data files given: set data.train_files / data.val_files to a parquet path or a list of paths")
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [os.path.expanduser(os.fspath(f)) for f in files]
    if not paths:
        raise DataFormatError("the list of data files is empty: give at least one parquet path")
    return paths


def read_rows(files: str | os.PathLike | Sequence[str | os.PathLike], prompt_key: str = "prompt",
              reward_fn_key: str = "data_source", need_reward_fn_key: bool = True, image_key: str = "images",
              refused_media: dict[str, str] | None = None) -> list[PromptRow]:
    """Load and validate every row of the given parquet files, in file order.

    ``reward_fn_key`` names the column read as each row's ``data_source``; without
    ``need_reward_fn_key`` (a custom reward function is given) a file may lack it. ``image_key``
    names the images column; ``refused_media`` maps the config key of each refused media column
    to its name (``{"data.video_key": "videos"}``): a file with a non-empty value there is refused.
    """
    rows: list[PromptRow] = []
    for path in normalize_file_list(files):
        rows.extend(_read_file(path, prompt_key, reward_fn_key, need_reward_fn_key, image_key, refused_media or {}))
    return rows


def _refuse_media(path: str, records: list[dict[str, Any]], refused_media: dict[str, str]) -> None:
    for config_key, column in refused_media.items():
        found = [i for i, record in enumerate(records) if record.get(column) not in (None, [], {}, "")]
        if found:
            shown = ", ".join(map(str, found[:5])) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            raise DataFormatError(
                f"{path}: {len(found)} row(s) hold {column!r} ({config_key}; rows {shown}): megarl does not train on "
                f"{column} yet (images only, data.image_key). Drop those rows or the column")


def _read_file(path: str, prompt_key: str, reward_fn_key: str, need_reward_fn_key: bool, image_key: str,
               refused_media: dict[str, str]) -> list[PromptRow]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path!r} (check data.train_files / data.val_files)")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DataFormatError(f"{path}: cannot be read as parquet: {exc}") from exc
    problems = column_problems(path, table.column_names, prompt_key, reward_fn_key, need_reward_fn_key)
    if problems:
        raise DataFormatError(problems[0])
    has_source = reward_fn_key in table.column_names
    try:
        records = to_python_rows(table, path)
    except InvalidUtf8 as exc:
        raise DataFormatError(str(exc)) from None
    _refuse_media(path, records, refused_media)
    return [_validate_row(record, path, i, prompt_key, reward_fn_key if has_source else None, image_key)
            for i, record in enumerate(records)]


def _validate_row(record: dict[str, Any], path: str, row: int, prompt_key: str, reward_fn_key: str | None,
                  image_key: str = "images") -> PromptRow:
    def fail(key: str, problem: str) -> DataFormatError:
        return DataFormatError(f"{path}: row {row}: key {key!r}: {problem}")

    data_source = record.get(reward_fn_key) if reward_fn_key else UNKNOWN_SOURCE
    if not isinstance(data_source, str) or not data_source:
        raise fail(reward_fn_key, f"must be a non-empty string (data.reward_fn_key), got {data_source!r}")

    messages = record.get(prompt_key)
    if not isinstance(messages, list):
        raise fail(prompt_key, f"must be a list of chat messages {{role, content}}, got {type(messages).__name__}: {messages!r:.80}")
    if not messages:
        raise fail(prompt_key, "is an empty list: a prompt needs at least one message")
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise fail(f"{prompt_key}[{j}]", f"must be a dict with 'role' and 'content', got {type(message).__name__}")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise fail(f"{prompt_key}[{j}].{field}", f"must be a string, got {message.get(field)!r:.80}")
    if not any(message["content"].strip() for message in messages):
        raise fail(prompt_key, "every message content is empty")

    ability = record.get("ability", "")
    if ability is None:
        ability = ""
    if not isinstance(ability, str):
        raise fail("ability", f"must be a string, got {type(ability).__name__}")

    reward_model = record.get("reward_model")
    if not isinstance(reward_model, dict):
        raise fail("reward_model", f"must be a struct {{style, ground_truth}}, got {type(reward_model).__name__}")
    if reward_model.get("ground_truth") is None:
        raise fail("reward_model.ground_truth", "is missing or null")

    extra_info = record.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise fail("extra_info", f"must be a struct/dict or null, got {type(extra_info).__name__}")

    agent_name = record.get("agent_name")
    if agent_name is not None and (not isinstance(agent_name, str) or not agent_name):
        raise fail("agent_name", f"must be a non-empty string (an agent loop name) or null, got {agent_name!r}")

    images = record.get(image_key)
    if images is not None and not isinstance(images, list):
        raise fail(image_key, f"must be a list of images (data.image_key) or null, got {type(images).__name__}")

    return PromptRow(
        images=tuple(images or ()),
        agent_name=agent_name,
        messages=[{"role": m["role"], "content": m["content"]} for m in messages],
        data_source=data_source,
        ability=ability,
        reward_model=dict(reward_model),
        extra_info=dict(extra_info),
        source_file=path,
        row_number=row,
    )
