"""SmolLM2-135M-Instruct through the conversion CLI: ``hf-to-megatron`` at TP=3 (3 torchrun ranks)
then ``megatron-to-hf`` at TP=1 reproduces every real tensor bit for bit and carries the real
config, tokenizer and chat template over; TP=2 (9 heads) is refused before any process starts."""
import json

import pytest
import torch
from safetensors import safe_open

from conversion.__main__ import main as conversion_main
from tests.conversion.conftest import assert_ok, run_cli
from tests.pretrained.conftest import CONVERSATIONS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def round_trip(smollm2, tmp_path_factory):
    work = tmp_path_factory.mktemp("smollm2_conversion")
    # saved at TP=3 (one KV group per rank), read back at TP=1: dist_checkpointing reshards real tensors
    assert_ok(run_cli(["hf-to-megatron", "--hf", smollm2, "--out", work / "mcore", "--tp", "3"], nproc=3, timeout=300))
    assert_ok(run_cli(["megatron-to-hf", "--checkpoint", work / "mcore", "--hf-config", smollm2,
                       "--out", work / "hf"], timeout=300))
    return work / "hf"


def test_every_tensor_is_reproduced_bit_for_bit(smollm2, round_trip):
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as a, \
            safe_open(str(round_trip / "model.safetensors"), framework="pt") as b:
        assert sorted(b.keys()) == sorted(a.keys())
        assert "lm_head.weight" not in b.keys()  # tied embeddings stay tied
        for name in a.keys():
            original, converted = a.get_tensor(name), b.get_tensor(name)
            assert converted.dtype == original.dtype == torch.float32, name
            assert torch.equal(converted, original), name


def test_config_tokenizer_and_chat_template_are_carried_over(smollm2, round_trip):
    from transformers import AutoTokenizer

    assert json.loads((round_trip / "config.json").read_text()) == json.loads((smollm2 / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (round_trip / name).read_bytes() == (smollm2 / name).read_bytes(), name
    original, converted = AutoTokenizer.from_pretrained(str(smollm2)), AutoTokenizer.from_pretrained(str(round_trip))
    for conversation in CONVERSATIONS:
        rendered = converted.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert rendered == original.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith("<|im_start|>") and rendered.endswith("<|im_start|>assistant\n")


def test_tp2_is_refused_before_any_process_starts(smollm2, tmp_path, capsys):
    code = conversion_main(["hf-to-megatron", "--hf", str(smollm2), "--out", str(tmp_path / "out"), "--tp", "2"])
    error = capsys.readouterr().err
    assert code == 2
    assert "num_attention_heads=9 is not divisible by tp=2" in error, error
    assert "torchrun" not in error  # the layout is wrong for this model: no process count helps
    assert not (tmp_path / "out").exists()
