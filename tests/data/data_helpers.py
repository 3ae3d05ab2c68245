"""Helpers for the data tests: a character-level tokenizer with a ChatML chat template.

One token per character makes every expected token id computable by hand in the
tests, independently of the code under test.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "[UNK]"]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="[UNK]"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def expected_chatml_ids(messages: list[dict[str, str]]) -> list[int]:
    """The ChatML token ids of ``messages`` plus the generation prompt, built by hand."""
    ids: list[int] = []
    for message in messages:
        ids.append(VOCAB["<|im_start|>"])
        ids.extend(VOCAB[c] for c in message["role"] + "\n" + message["content"])
        ids.append(VOCAB["<|im_end|>"])
        ids.append(VOCAB["\n"])
    ids.append(VOCAB["<|im_start|>"])
    ids.extend(VOCAB[c] for c in "assistant\n")
    return ids


def verl_row(question: str, answer: str, index: int, data_source: str = "openai/gsm8k") -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index},
    }


def write_parquet(rows: list[dict], path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_with_latin1(rows: list[dict], path, bad_row: int, column: str) -> str:
    """``rows`` as verl's parquet, with row ``bad_row``'s text in ``column`` stored as Latin-1 bytes: what a
    writer that does not check the encoding of a string column (a latin-1 export, raw bytes) leaves."""
    table = pa.Table.from_pylist(rows)
    kind = table.schema.field(column).type

    def as_bytes(value, row):
        if isinstance(value, str):
            return value.encode("latin-1" if row == bad_row else "utf-8")
        if isinstance(value, list):
            return [as_bytes(v, row) for v in value]
        return {k: as_bytes(v, row) for k, v in value.items()} if isinstance(value, dict) else value

    def binary(t):  # the same layout with binary in place of string: bytes go in unchecked
        if pa.types.is_string(t):
            return pa.binary()
        if pa.types.is_list(t):
            return pa.list_(binary(t.value_type))
        return pa.struct([(f.name, binary(f.type)) for f in t]) if pa.types.is_struct(t) else t

    raw = pa.array([as_bytes(r[column], i) for i, r in enumerate(rows)], type=binary(kind))
    table = table.set_column(table.column_names.index(column), column, raw.view(kind))
    pq.write_table(table, path)
    return str(path)
