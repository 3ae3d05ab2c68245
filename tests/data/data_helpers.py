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
