"""PromptDataset: verl-format round trip, chat template, length filtering/truncation, malformed input."""
from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.data.data_helpers import VOCAB, expected_chatml_ids, verl_row, write_parquet, write_with_latin1
from omegaconf import OmegaConf

from megarl.data import DataFormatError, PromptDataset, collate
from megarl.settings.data import build_dataset, build_train_loader

QUESTIONS = ["What is 3 + 4?", "Add 10 and 20.", "Tom has 5 apples and eats 2. How many are left?"]
ANSWERS = ["7", "30", "3"]


def _rows():
    return [verl_row(q, a, i) for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS))]


def test_round_trip_and_chat_template(tmp_path, tokenizer):
    rows = _rows()
    path = write_parquet(rows, tmp_path / "train.parquet")
    dataset = PromptDataset(path, tokenizer, max_prompt_length=512)

    assert len(dataset) == len(rows)
    for i, (row, item) in enumerate(zip(rows, dataset)):
        assert item.index == i
        assert item.raw_prompt == row["prompt"]
        assert item.data_source == row["data_source"]
        assert item.ability == row["ability"]
        assert item.reward_model == row["reward_model"]
        assert item.ground_truth == row["reward_model"]["ground_truth"]
        assert item.extra_info == row["extra_info"]
        # ChatML text with the generation prompt, and its ids built by hand from the vocabulary
        assert item.prompt_text == f"<|im_start|>user\n{QUESTIONS[i]}<|im_end|>\n<|im_start|>assistant\n"
        assert item.prompt_ids == expected_chatml_ids(row["prompt"])

    columns = collate([dataset[0], dataset[2]])
    assert columns["ground_truth"] == ["7", "3"]
    assert columns["index"] == [0, 2]
    assert columns["prompt_ids"][1] == expected_chatml_ids(rows[2]["prompt"])


def test_several_files_multi_turn_and_prompt_key(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    first = [{**verl_row("a?", "1", 0), "question_chat": messages}]
    second = [{**verl_row("b?", "2", 0), "question_chat": messages}, {**verl_row("c?", "3", 1), "question_chat": messages}]
    paths = [write_parquet(first, tmp_path / "a.parquet"), write_parquet(second, tmp_path / "b.parquet")]
    dataset = PromptDataset(paths, tokenizer, prompt_key="question_chat", max_prompt_length=512)
    assert [item.index for item in dataset] == [0, 1, 2]  # stable ids continue across files
    assert [item.ground_truth for item in dataset] == ["1", "2", "3"]
    assert dataset[1].prompt_ids == expected_chatml_ids(messages)


def test_optional_columns_may_be_absent(tmp_path, tokenizer):
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}]
    dataset = PromptDataset(write_parquet(rows, tmp_path / "t.parquet"), tokenizer)
    assert dataset[0].ability == "" and dataset[0].extra_info == {}


def _length(question: str) -> int:
    return len(expected_chatml_ids([{"role": "user", "content": question}]))


def test_overlong_prompts_are_filtered_and_counted(tmp_path, tokenizer, caplog):
    limit = _length("x" * 20)
    questions = ["x" * 5, "x" * 21, "x" * 20, "x" * 40, "x" * 1]  # rows 1 and 3 exceed the limit
    path = write_parquet([verl_row(q, str(i), i) for i, q in enumerate(questions)], tmp_path / "t.parquet")
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = PromptDataset(path, tokenizer, max_prompt_length=limit)
    assert dataset.num_filtered == 2
    assert [item.index for item in dataset] == [0, 2, 4]
    assert all(len(item.prompt_ids) <= limit for item in dataset)
    assert "filtered 2 of 5 prompts" in caplog.text


def test_truncation_error_names_file_and_row(tmp_path, tokenizer):
    limit = _length("x" * 10)
    path = write_parquet([verl_row("x" * 3, "1", 0), verl_row("x" * 11, "2", 1)], tmp_path / "long.parquet")
    with pytest.raises(DataFormatError, match=r"long\.parquet: row 1: prompt has \d+ tokens") as info:
        PromptDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation="error")
    assert f"max_prompt_length={limit}" in str(info.value)


def test_truncation_error_counts_every_overlong_prompt_at_once(tmp_path, tokenizer):
    """With filtering off, one error counts all the prompts over the limit (not the first one alone)."""
    limit = _length("x" * 10)
    questions = ["x" * 3, "x" * 11, "x" * 12, "x" * 2, "x" * 13, "x" * 14, "x" * 40]
    path = write_parquet([verl_row(q, str(i), i) for i, q in enumerate(questions)], tmp_path / "long.parquet")
    with pytest.raises(DataFormatError) as info:
        PromptDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation="error")
    message = str(info.value)
    assert message.startswith(f"5 of 7 prompts are longer than data.max_prompt_length={limit} tokens "
                              f"(the longest has {_length('x' * 40)})")
    assert "row 1: prompt has" in message and "row 4: prompt has" in message and "; and 2 more." in message


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tmp_path, tokenizer, mode):
    question = "abcdefghijklmnopqrstuvwxyz"
    full = expected_chatml_ids([{"role": "user", "content": question}])
    limit = len(full) - 7
    expected = {"left": full[-limit:], "right": full[:limit], "middle": full[: limit // 2] + full[-(limit - limit // 2):]}[mode]
    path = write_parquet([verl_row(question, "1", 0)], tmp_path / "t.parquet")
    dataset = PromptDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation=mode)
    assert dataset[0].prompt_ids == expected and len(expected) == limit
    assert dataset.num_truncated == 1


def test_everything_filtered_is_an_error(tmp_path, tokenizer):
    path = write_parquet([verl_row("x" * 50, "1", 0)], tmp_path / "t.parquet")
    with pytest.raises(DataFormatError, match="no prompts left.*longer than data.max_prompt_length=10"):
        PromptDataset(path, tokenizer, max_prompt_length=10)


def test_missing_file_names_the_path(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        PromptDataset(str(tmp_path / "nope.parquet"), tokenizer)


def test_missing_column_names_file_and_column(tmp_path, tokenizer):
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": "hi"}]}]
    path = write_parquet(rows, tmp_path / "nocol.parquet")
    with pytest.raises(DataFormatError, match=r"nocol\.parquet: missing column\(s\) \['reward_model'\]"):
        PromptDataset(path, tokenizer)


def test_prompt_column_of_wrong_type(tmp_path, tokenizer):
    rows = [{"data_source": "x", "prompt": "just a string", "reward_model": {"ground_truth": "1"}}]
    path = write_parquet(rows, tmp_path / "strprompt.parquet")
    with pytest.raises(DataFormatError, match=r"strprompt\.parquet: row 0: key 'prompt': must be a list of chat messages"):
        PromptDataset(path, tokenizer)


@pytest.mark.parametrize(
    "bad_row, key",
    [
        ({"prompt": []}, "'prompt': is an empty list"),
        ({"prompt": [{"role": "user", "content": None}]}, r"'prompt\[0\].content': must be a string"),
        ({"prompt": [{"role": "user", "content": "  "}]}, "'prompt': every message content is empty"),
        ({"data_source": ""}, "'data_source': must be a non-empty string"),
        ({"reward_model": {"style": "rule", "ground_truth": None}}, "'reward_model.ground_truth': is missing or null"),
    ],
)
def test_bad_row_names_file_row_and_key(tmp_path, tokenizer, bad_row, key):
    rows = [verl_row("fine?", "1", i) for i in range(4)]
    rows[2] = {**rows[2], **bad_row}
    path = write_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(DataFormatError, match=rf"bad\.parquet: row 2: key {key}"):
        PromptDataset(path, tokenizer)


@pytest.mark.parametrize("rows, bad_row, column, key", [
    (4, 2, "prompt", r"prompt\[0\]\.content"),
    (5000, 4500, "data_source", "data_source"),  # past the first block of rows the search converts at once
])
def test_text_that_is_not_utf8_names_file_row_and_key(tmp_path, tokenizer, rows, bad_row, column, key):
    rows = [verl_row(f"What is {i} + 1? café", str(i + 1), i, data_source="café/arith") for i in range(rows)]
    path = write_with_latin1(rows, tmp_path / "latin1.parquet", bad_row, column)
    with pytest.raises(UnicodeDecodeError):
        pq.read_table(path).to_pylist()  # what the reader met before: no file, row or column
    with pytest.raises(DataFormatError, match=rf"latin1\.parquet: row {bad_row}: key '{key}': the text is not "
                                              r"valid UTF-8 \(byte 0xe9 at byte \d+: b'.*caf\\xe9"):
        PromptDataset(path, tokenizer)


def test_reward_model_of_wrong_type(tmp_path, tokenizer):
    table = pa.table({
        "data_source": ["x"],
        "prompt": [[{"role": "user", "content": "hi"}]],
        "reward_model": ["7"],  # a string, not a struct
    })
    path = tmp_path / "rm.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataFormatError, match=r"rm\.parquet: row 0: key 'reward_model': must be a struct"):
        PromptDataset(str(path), tokenizer)


def test_tokenizer_without_chat_template(tmp_path, tokenizer):
    from tests.data.data_helpers import build_char_tokenizer

    plain = build_char_tokenizer()
    plain.chat_template = None
    path = write_parquet(_rows(), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match="no chat_template"):
        PromptDataset(path, plain)


def test_build_from_config(tmp_path, tokenizer):
    train = write_parquet(_rows(), tmp_path / "train.parquet")
    cfg = OmegaConf.create({
        "train_files": [train], "val_files": train, "prompt_key": "prompt", "max_prompt_length": 128,
        "truncation": "error", "filter_overlong_prompts": True, "train_batch_size": 2, "shuffle": False, "seed": 3,
    })
    loader = build_train_loader(cfg, tokenizer)
    assert len(loader) == 1  # 3 prompts, batches of 2, drop_last
    assert [item.index for item in loader.next_batch().items] == [0, 1]
    val = build_dataset(cfg, tokenizer, "val")
    assert len(val) == 3 and val[0].prompt_ids[0] == VOCAB["<|im_start|>"]


def test_data_source_column_is_data_reward_fn_key_and_optional_with_a_custom_reward(tmp_path, tokenizer):
    rows = [{k: v for k, v in verl_row(f"q{i}", str(i), i).items() if k != "data_source"} | {"task": f"t{i % 2}"}
            for i in range(3)]
    path = write_parquet(rows, tmp_path / "seed.parquet")
    with pytest.raises(DataFormatError, match=r"missing column\(s\) \['data_source'\].*custom_reward_function.path"):
        PromptDataset(path, tokenizer)
    assert [it.data_source for it in PromptDataset(path, tokenizer, need_reward_fn_key=False)] == ["unknown"] * 3
    assert [it.data_source for it in PromptDataset(path, tokenizer, reward_fn_key="task")] == ["t0", "t1", "t0"]


def test_max_samples_takes_the_first_rows_or_verls_seeded_draw(tmp_path, tokenizer):
    import numpy as np

    path = write_parquet([verl_row(f"q{i}", str(i), i) for i in range(10)], tmp_path / "ten.parquet")
    first = PromptDataset(path, tokenizer, max_samples=3, shuffle=False)
    assert [it.ground_truth for it in first] == ["0", "1", "2"]
    drawn = PromptDataset(path, tokenizer, max_samples=3, shuffle=True, seed=7)
    expected = np.random.default_rng(7).choice(10, size=3, replace=False).tolist()  # verl's RLHFDataset draw
    assert [it.ground_truth for it in drawn] == [str(i) for i in expected]
    cfg = OmegaConf.create({"train_files": path, "train_batch_size": 2, "train_max_samples": 4, "val_max_samples": 2,
                            "val_files": path, "shuffle": False})
    assert len(build_dataset(cfg, tokenizer, "train")) == 4 and len(build_dataset(cfg, tokenizer, "val")) == 2
