"""gpt-oss's MXFP4 checkpoints through the conversion CLI: ``hf-to-megatron`` at EP=2 (each rank reads and
dequantises only its own experts' blocks and scales), ``megatron-to-hf`` writes the dequantised experts (fp32
here: the dtype of the checkpoint's unquantised tensors) without ``quantization_config``, equal bit for bit to
transformers' dequantisation (``tests/models/mxfp4_fixture.py``); ``verify`` of the converted checkpoint
against the MXFP4 one (transformers on the dequantised weights) passes."""
import json

import pytest
import torch
from safetensors import safe_open

from tests.conversion.conftest import assert_ok, run_cli
from tests.conversion.test_verify import max_diff
from tests.models.mxfp4_fixture import make_mxfp4_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4_conversion")
    _, dequantized = make_mxfp4_checkpoint(root)
    assert_ok(run_cli(["hf-to-megatron", "--hf", root / "mxfp4", "--out", root / "mcore", "--ep", "2"], nproc=2))
    assert_ok(run_cli(["megatron-to-hf", "--checkpoint", root / "mcore", "--hf-config", root / "mxfp4",
                       "--out", root / "hf"]))
    return root, dequantized


def test_export_holds_the_dequantised_experts_bit_for_bit(converted):
    root, dequantized = converted
    with safe_open(str(root / "hf" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(dequantized)  # no *_blocks or *_scales left
        for name, expected in dequantized.items():
            assert torch.equal(f.get_tensor(name), expected), name
    assert "quantization_config" not in json.loads((root / "hf" / "config.json").read_text())


def test_verify_of_the_conversion_against_the_mxfp4_checkpoint(converted):
    root, _ = converted
    done = run_cli(["verify", "--hf", root / "mxfp4", "--megatron", root / "mcore", "--ep", "2"], nproc=2)
    assert_ok(done)
    assert max_diff(done.stdout) < 1e-5
