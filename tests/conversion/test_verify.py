"""``verify`` passes (max diff < 1e-5, exit 0) on a faithful conversion and fails (exit 1) on a perturbed one."""
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.conversion.conftest import assert_ok, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def max_diff(stdout: str) -> float:
    found = re.search(r"max \|megatron - HF\| logits = (\S+)", stdout)
    assert found, stdout
    return float(found.group(1))


def test_verify_accepts_a_faithful_tp2_checkpoint(tiny_models, to_megatron):
    source = tiny_models / "llama"
    done = run_cli(["verify", "--hf", source, "--megatron", to_megatron("llama", ("--tp", "2"), 2)])
    assert_ok(done)
    assert max_diff(done.stdout) < 1e-5


def test_verify_accepts_a_faithful_deepseek_v3_ep2_checkpoint(tiny_models, to_megatron):
    source = tiny_models / "deepseek_v3"
    done = run_cli(["verify", "--hf", source, "--megatron", to_megatron("deepseek_v3", ("--ep", "2"), 2)])
    assert_ok(done)
    assert max_diff(done.stdout) < 1e-5


def test_verify_accepts_a_faithful_gemma2_tp2_checkpoint(tiny_models, to_megatron):
    """Gemma-2's attention soft-cap clips on the tiny model: the reference must be transformers' eager
    attention (its SDPA path drops the cap, 9e-3 off)."""
    source = tiny_models / "gemma2"
    done = run_cli(["verify", "--hf", source, "--megatron", to_megatron("gemma2", ("--tp", "2"), 2)])
    assert_ok(done)
    assert max_diff(done.stdout) < 1e-5


def test_a_kimi_k2_config_converts_and_verifies_in_fresh_processes(tiny_models, to_megatron):
    """model_type kimi_k2, unknown to transformers: each CLI process registers it from its config.json."""
    source = tiny_models / "kimi_k2"
    done = run_cli(["verify", "--hf", source, "--megatron", to_megatron("kimi_k2", (), 1)])
    assert_ok(done)
    assert max_diff(done.stdout) < 1e-5


def test_a_checkpoint_loads_under_another_vocabulary_padding(tiny_models, to_megatron):
    """Converted with the vocabulary padded to 512 rows, loaded padded to 768 (megatron's
    allow_shape_mismatch for the embedding and output layer): the logits are HF's."""
    source = tiny_models / "llama"
    checkpoint = to_megatron("llama", (), 1)
    done = run_cli(["verify", "--hf", source, "--megatron", checkpoint, "--make-vocab-size-divisible-by", "384"])
    assert_ok(done)
    assert max_diff(done.stdout) < 1e-5


def test_verify_rejects_a_perturbed_checkpoint(tiny_models, tmp_path):
    source = tiny_models / "llama"
    perturbed = tmp_path / "perturbed"
    shutil.copytree(source, perturbed)
    tensors = load_file(str(perturbed / "model.safetensors"))
    tensors["model.layers.1.post_attention_layernorm.weight"] += 0.01
    save_file(tensors, str(perturbed / "model.safetensors"), metadata={"format": "pt"})
    assert_ok(run_cli(["hf-to-megatron", "--hf", perturbed, "--out", tmp_path / "mcore"]))
    done = run_cli(["verify", "--hf", source, "--megatron", tmp_path / "mcore"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert max_diff(done.stdout) > 1e-5
    assert "FAILED" in done.stdout


def test_verify_on_smollm2_holds_the_conversion_to_transformers_own_noise_floor(smollm2):
    """SmolLM2 through the bridge with no conversion at all: the old fixed 1e-5 failed it (transformers' own eager
    and sdpa logits differ by ~7e-5 here); the default tolerance is 4x that gap, printed with its source."""
    done = run_cli(["verify", "--hf", smollm2], timeout=300)
    assert_ok(done)
    found = re.search(r"tolerance (\S+): 4 x transformers' eager-vs-sdpa gap (\S+), at least 1e-05\): OK", done.stdout)
    assert found, done.stdout
    tolerance, gap = float(found.group(1)), float(found.group(2))
    assert 1e-6 < gap < 1e-3 and tolerance == pytest.approx(4 * gap, rel=0.05)
    assert max_diff(done.stdout) <= tolerance
    strict = run_cli(["verify", "--hf", smollm2, "--tolerance", "1e-12"], timeout=300)  # an explicit one is kept
    assert strict.returncode == 1 and "(tolerance 1.0e-12: --tolerance): FAILED" in strict.stdout


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_verify_compares_a_vision_language_checkpoint_on_an_image_and_catches_a_changed_tower(
        family, tiny_models, to_megatron, tmp_path):
    """A VL checkpoint is compared with AutoModelForImageTextToText on the texts and an image row: a faithful
    TP=2 conversion passes; one whose vision tower differs in one tensor fails (the image row sees it)."""
    source = tiny_models / family
    done = run_cli(["verify", "--hf", source, "--megatron", to_megatron(family, ("--tp", "2"), 2)])
    assert_ok(done)
    assert "(the last with an image)" in done.stdout and max_diff(done.stdout) < 1e-5
    perturbed = tmp_path / "perturbed"
    shutil.copytree(source, perturbed)
    tensors = load_file(str(perturbed / "model.safetensors"))
    tower = "visual." if family == "qwen2_5_vl" else "model.visual."
    tensors[f"{tower}merger.mlp.0.bias" if family == "qwen2_5_vl" else f"{tower}merger.linear_fc1.bias"] += 0.05
    save_file(tensors, str(perturbed / "model.safetensors"), metadata={"format": "pt"})
    assert_ok(run_cli(["hf-to-megatron", "--hf", perturbed, "--out", tmp_path / "mcore"]))
    done = run_cli(["verify", "--hf", source, "--megatron", tmp_path / "mcore"])
    assert done.returncode == 1 and "FAILED" in done.stdout, done.stdout + done.stderr
