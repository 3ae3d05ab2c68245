"""Shared inputs for the SmolLM2-135M-Instruct tests: real chat conversations through the real
tokenizer and chat template (the ``smollm2`` checkpoint fixture itself is in tests/conftest.py)."""
import pytest

CONVERSATIONS = [
    [{"role": "user", "content": "What is 15 + 27?"}, {"role": "assistant", "content": "15 + 27 = 42."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"}],
]


def chat_token_ids(model_dir) -> list[list[int]]:
    """The conversations rendered by the checkpoint's own chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in CONVERSATIONS]


@pytest.fixture(scope="session")
def chat_batch(smollm2):
    """[2, longest] token ids of the conversations, right-padded with the tokenizer's pad id."""
    import torch
    from transformers import AutoTokenizer

    rows = chat_token_ids(smollm2)
    pad = AutoTokenizer.from_pretrained(str(smollm2)).pad_token_id
    longest = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (longest - len(r)) for r in rows])
