"""FP8 block-quantised checkpoints (DeepSeek-V3's format) are dequantised as they are read.

The checkpoint is quantised in the test (``fp8_fixture``: sizes that are no multiple of 128, so
slices cut blocks and last blocks are ragged) and compared with a block-by-block dequantisation
written independently there; a model built from the FP8 checkpoint must give transformers' logits
on the reference-dequantised weights.
"""
import json
import re

import pytest
import torch
from safetensors import safe_open

from megarl.models import ParallelLayout, build_model
from megarl.models import fp8
from megarl.models.loading import checkpoint_files
from tests.models.fp8_fixture import QUANTIZATION, make_fp8_checkpoint, quantize, reference_dequantize

TOLERANCE = 1e-5
GATE = "model.layers.1.mlp.gate_proj.weight"  # [320, 192]: 3 x 2 blocks, last row block 64, last column block 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    reference = make_fp8_checkpoint(root)
    return root, reference


def _dequantizer(model_dir):
    return fp8.Dequantizer(model_dir, checkpoint_files(model_dir), fp8.BlockFP8())


def _stored_slice(model_dir, name, hf_slice):
    files = checkpoint_files(model_dir)
    with safe_open(str(model_dir / files[name]), framework="pt") as f:
        return f.get_slice(name)[hf_slice]


@pytest.mark.parametrize("rows,cols", [
    (slice(160, 320), slice(0, 192)),   # TP=2 rank 1 of the FFN: starts mid-block, ends with the ragged block
    (slice(0, 160), slice(0, 192)),     # TP=2 rank 0: ends mid-block
    (slice(100, 260), slice(64, 192)),  # cuts row blocks 0-2 and column blocks 0-1, both ragged ends
    (slice(300, 301), slice(191, 192)),  # one element in the ragged corner block
    (slice(0, 320), slice(0, 192)),     # the whole tensor
])
def test_slices_dequantise_like_the_reference(checkpoints, rows, cols):
    root, reference = checkpoints
    values = _stored_slice(root / "fp8", GATE, (rows, cols))
    assert values.dtype == torch.float8_e4m3fn
    assert torch.equal(_dequantizer(root / "fp8")(GATE, (rows, cols), values), reference[GATE][rows, cols])


def test_a_slice_reads_only_the_scale_blocks_it_touches(checkpoints, monkeypatch):
    root, _ = checkpoints
    reads = []
    real_open = fp8.safe_open

    class Recording:
        def __init__(self, path, framework):
            self.inner = real_open(path, framework=framework)

        def get_slice(self, name):
            inner = self.inner.get_slice(name)

            class Slice:
                get_shape = inner.get_shape

                def __getitem__(self, index):
                    reads.append((name, index))
                    return inner[index]

            return Slice()

    monkeypatch.setattr(fp8, "safe_open", Recording)
    rows, cols = slice(160, 320), slice(130, 192)
    _dequantizer(root / "fp8")(GATE, (rows, cols), _stored_slice(root / "fp8", GATE, (rows, cols)))
    assert reads == [(GATE + "_scale_inv", (slice(1, 3), slice(1, 2)))]  # row blocks 1-2, column block 1 only


def test_scale_in_another_file_is_found(checkpoints):
    root, reference = checkpoints
    name = "model.layers.0.self_attn.q_proj.weight"
    files = checkpoint_files(root / "fp8")
    assert files[name] != files[name + "_scale_inv"]
    full = (slice(0, 192), slice(0, 192))
    assert torch.equal(_dequantizer(root / "fp8")(name, full, _stored_slice(root / "fp8", name, full)), reference[name])


def test_e8m0_scales_dequantise_like_the_reference(tmp_path):
    """``scale_fmt: ue8m0`` (DeepSeek-V3.1 and later): power-of-two scales, here stored in one byte."""
    from safetensors.torch import save_file

    weight = torch.randn(200, 130)
    quantized, scales = quantize(weight)
    scales = torch.exp2(torch.ceil(torch.log2(scales)))  # ue8m0 scales are powers of two
    quantized = (weight / scales.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130]).to(torch.float8_e4m3fn)
    save_file({"w": quantized, "w_scale_inv": scales.to(torch.float8_e8m0fnu)}, str(tmp_path / "model.safetensors"))
    full = (slice(0, 200), slice(0, 130))
    assert fp8.block_fp8(_config({**QUANTIZATION, "scale_fmt": "ue8m0"})) == fp8.BlockFP8()
    dequantized = fp8.Dequantizer(tmp_path, {"w": "model.safetensors", "w_scale_inv": "model.safetensors"}, fp8.BlockFP8())
    assert torch.equal(dequantized("w", full, quantized), reference_dequantize(quantized, scales))


def test_model_from_fp8_checkpoint_gives_hf_logits_on_dequantised_weights(world, checkpoints):
    from transformers import AutoModelForCausalLM

    root, reference = checkpoints
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(root / "dequant"), dtype=torch.float32).eval()(input_ids).logits
        [model] = build_model(root / "fp8", ParallelLayout())
        logits = model.eval()(input_ids, torch.arange(16).unsqueeze(0), None)
    assert (logits - expected).abs().max() <= TOLERANCE
    fc1 = model.decoder.layers[1].mlp.linear_fc1.weight  # [gate; up], dequantised exactly as the reference
    assert torch.equal(fc1[:320], reference[GATE]) and torch.equal(fc1[320:], reference[GATE.replace("gate", "up")])


def _config(quantization):
    from transformers import LlamaConfig

    return LlamaConfig(quantization_config=quantization)


@pytest.mark.parametrize("quantization,field", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({**QUANTIZATION, "weight_block_size": [64, 64]}, "weight_block_size"),
    ({**QUANTIZATION, "weight_block_size": None}, "weight_block_size"),  # per-tensor FP8
    ({**QUANTIZATION, "fmt": "e5m2"}, "fmt"),
    ({**QUANTIZATION, "activation_scheme": "static"}, "activation_scheme"),
])
def test_other_quantisations_are_refused_naming_the_field(quantization, field):
    with pytest.raises(ValueError, match=rf"quantization_config\.{field}=.* is not supported: .*weight_block_size \[128, 128\]"):
        fp8.block_fp8(_config(quantization))


def test_unquantised_config_reads_as_such():
    assert fp8.block_fp8(_config(None)) is None
    assert fp8.block_fp8(_config(QUANTIZATION)) == fp8.BlockFP8((128, 128))


def test_fp8_tensor_without_quantization_config_is_refused(checkpoints):
    root, _ = checkpoints
    values = _stored_slice(root / "fp8", GATE, (slice(0, 320), slice(0, 192)))
    plain = fp8.Dequantizer(root / "fp8", checkpoint_files(root / "fp8"), None)
    with pytest.raises(ValueError, match="stored as torch.float8_e4m3fn but .*config.json declares no quantization_config"):
        plain(GATE, (slice(0, 320), slice(0, 192)), values)


def test_fp8_tensor_of_another_format_is_refused(checkpoints):
    root, _ = checkpoints
    values = _stored_slice(root / "fp8", GATE, (slice(0, 320), slice(0, 192))).to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="stored as torch.float8_e5m2 but .*config.json declares fmt e4m3"):
        _dequantizer(root / "fp8")(GATE, (slice(0, 320), slice(0, 192)), values)


def test_missing_or_misshapen_scale_is_refused(tmp_path):
    from safetensors.torch import save_file

    quantized, scales = quantize(torch.randn(320, 192))
    save_file({"w": quantized, "w_scale_inv": scales[:1]}, str(tmp_path / "model.safetensors"))
    full = (slice(0, 320), slice(0, 192))
    without_scale = fp8.Dequantizer(tmp_path, {"w": "model.safetensors"}, fp8.BlockFP8())
    with pytest.raises(KeyError, match="has no w_scale_inv"):
        without_scale("w", full, quantized)
    misshapen = fp8.Dequantizer(tmp_path, {"w": "model.safetensors", "w_scale_inv": "model.safetensors"}, fp8.BlockFP8())
    with pytest.raises(ValueError, match=r"w_scale_inv has shape \(1, 2\); \(320, 192\) in 128x128 blocks needs \(3, 2\)"):
        misshapen("w", full, quantized)


def test_loader_refuses_other_quantisations_before_reading(world, checkpoints, tmp_path):
    import shutil

    root, _ = checkpoints
    shutil.copytree(root / "fp8", tmp_path / "gptq")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method='awq' is not supported"):
        build_model(tmp_path / "gptq", ParallelLayout())


def test_an_fp8_or_other_quantised_model_path_is_a_config_problem(checkpoints, tmp_path):
    """The config check (preflight) names the FP8 checkpoint and the conversion, as a problem of
    actor_rollout_ref.model.path, instead of ``run`` raising it as a traceback; another quantisation too."""
    import shutil

    from megarl.checks import ConfigError, load_config
    from tests.config._fixtures import write_prompts
    from tests.config.test_preflight import BATCH

    root, _ = checkpoints
    data = write_prompts(tmp_path / "train.parquet", rows=8)
    shutil.copytree(root / "fp8", tmp_path / "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    for model, expected in ((root / "fp8", "is FP8 block-quantised: .* megatron-to-hf --checkpoint MCORE"),
                            (tmp_path / "awq", r"quantization_config\.quant_method='awq' is not supported")):
        with pytest.raises(ConfigError) as info:
            load_config(None, [*BATCH, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}"],
                        preflight=True)
        (problem,) = [p for p in info.value.problems if p.key == "actor_rollout_ref.model.path"]
        assert re.search(expected, problem.message), problem.message


def test_training_from_an_fp8_model_path_is_refused_before_any_process_starts(checkpoints):
    from megarl.checks import load_config
    from megarl.run.train import run

    root, _ = checkpoints
    cfg = load_config(None, ["data.train_files=unused.parquet", f"actor_rollout_ref.model.path={root / 'fp8'}",
                             "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    with pytest.raises(ValueError, match="is FP8 block-quantised: .* megatron-to-hf --checkpoint MCORE"):
        run(cfg)
