import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tokenizer():
    from tests.data.data_helpers import build_char_tokenizer

    return build_char_tokenizer()
