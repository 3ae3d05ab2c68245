import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tokenizer():
    from tests.data.data_helpers import build_char_tokenizer

    return build_char_tokenizer()


VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="session")
def vision_models(tmp_path_factory):
    """family -> (tokenizer, processor, checkpoint path) of the tiny Qwen2.5-VL and Qwen3-VL checkpoints (devtools.tiny_vision)."""
    from transformers import AutoProcessor, AutoTokenizer

    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("vision")
    paths = {family: make_tiny_model(family, "tiny", root / family) for family in VISION_FAMILIES}
    return {family: (AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path), path)
            for family, path in paths.items()}
