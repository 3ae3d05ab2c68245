"""FP8 block-quantised checkpoints through the conversion CLI: ``hf-to-megatron`` at TP=2 (each rank
reads and dequantises its own slices, which cut 128x128 blocks) then ``megatron-to-hf`` writes the
dequantised weights (fp32 here: the dtype of the checkpoint's unquantised tensors) without
``quantization_config``, equal bit for bit to the test's own reference dequantisation; ``verify``'s
reference is transformers on the dequantised weights; other quantisations are refused."""
import json

import pytest
import torch
from safetensors import safe_open

from conversion.__main__ import main as conversion_main
from tests.conversion.conftest import assert_ok, run_cli
from tests.models.fp8_fixture import make_fp8_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_conversion")
    reference = make_fp8_checkpoint(root)
    assert_ok(run_cli(["hf-to-megatron", "--hf", root / "fp8", "--out", root / "mcore", "--tp", "2"], nproc=2))
    assert_ok(run_cli(["megatron-to-hf", "--checkpoint", root / "mcore", "--hf-config", root / "fp8", "--out", root / "hf"]))
    return root, reference


def test_export_holds_the_dequantised_weights_bit_for_bit(converted):
    root, reference = converted
    with safe_open(str(root / "hf" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(reference)  # no *_scale_inv left
        for name, expected in reference.items():
            assert f.get_slice(name).get_dtype() == "F32", name
            assert torch.equal(f.get_tensor(name), expected), name


def test_export_config_drops_the_quantization(converted):
    from transformers import AutoModelForCausalLM

    root, _ = converted
    config = json.loads((root / "hf" / "config.json").read_text())
    assert "quantization_config" not in config
    expected = json.loads((root / "dequant" / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "transformers_version"} == {
        k: v for k, v in expected.items() if k != "transformers_version"}
    input_ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32)(input_ids).logits
        reference = AutoModelForCausalLM.from_pretrained(str(root / "dequant"), dtype=torch.float32)(input_ids).logits
    assert torch.equal(exported, reference)


def test_verify_reference_is_transformers_on_the_dequantised_weights(converted):
    """``verify``'s HF side for an FP8 checkpoint (transformers' own FP8 loader refuses ragged blocks)."""
    from transformers import AutoModelForCausalLM

    from conversion.verify import hf_model

    root, _ = converted
    input_ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        logits = hf_model(root / "fp8").eval()(input_ids).logits
        reference = AutoModelForCausalLM.from_pretrained(str(root / "dequant"), dtype=torch.float32,
                                                         attn_implementation="eager")(input_ids).logits
    assert torch.equal(logits, reference)


def test_other_quantisation_is_refused_before_any_process_starts(converted, tmp_path, capsys):
    import shutil

    root, _ = converted
    shutil.copytree(root / "fp8", tmp_path / "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    assert conversion_main(["hf-to-megatron", "--hf", str(tmp_path / "awq"), "--out", str(tmp_path / "out")]) == 2
    assert "quantization_config.quant_method='awq' is not supported" in capsys.readouterr().err
