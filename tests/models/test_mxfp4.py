"""gpt-oss's MXFP4 expert weights are dequantised as they are read.

The tiny gpt-oss checkpoint's experts are quantised in the test and written in the published layout
(``tests/models/mxfp4_fixture.py``); the reference dequantisation is transformers' own
``convert_moe_packed_tensors``, which shares no code with ``megarl.models.mxfp4``, and ``dequant`` holds the
same checkpoint with the reference's weights. The conversion CLI at EP=2: tests/conversion/test_mxfp4_conversion.py.
"""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megarl.models import ParallelLayout, build_model
from megarl.models import mxfp4
from megarl.models.loading import checkpoint_files
from tests.models.mxfp4_fixture import EXPERTS, QUANTIZATION, make_mxfp4_checkpoint
from tests.models.mxfp4_fixture import reference_dequantize as _reference

TOLERANCE = 1e-5  # the bridge's tolerance against transformers (tests/models/test_bridge_tp1.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    return (root, *make_mxfp4_checkpoint(root))


def _stored(model_dir, name):
    files = checkpoint_files(model_dir)
    with safe_open(str(model_dir / files[name]), framework="pt") as f:
        return f.get_tensor(name)


def _reader(model_dir, quantization=mxfp4.MXFP4()):
    return mxfp4.ExpertReader(model_dir, checkpoint_files(model_dir), quantization)


def test_all_codes_and_scales_dequantise_like_transformers():
    blocks = torch.arange(256, dtype=torch.uint8).reshape(2, 4, 2, 16)  # every byte: every pair of codes
    scales = torch.tensor([0, 1, 2, 100, 126, 127, 128, 200], dtype=torch.uint8).reshape(2, 4, 1).expand(2, 4, 2)
    ours = mxfp4.dequantize(blocks, scales.contiguous()).transpose(1, 2)
    assert torch.equal(ours, _reference(blocks, scales))
    assert torch.equal(ours.bfloat16(), _reference(blocks, scales, torch.bfloat16))


def test_the_quantised_experts_are_close_to_the_originals(checkpoints):
    """The test's quantiser is sound (so the tensors compared below are the tiny model's, roughly)."""
    _, tensors, dequantized = checkpoints
    for name in EXPERTS:
        error = (dequantized[name] - tensors[name]).abs().max() / tensors[name].abs().max()
        assert 0 < error <= 0.25, (name, error)


@pytest.mark.parametrize("name", EXPERTS)
def test_expert_rows_equal_transformers_dequantisation(checkpoints, name):
    root, _, dequantized = checkpoints
    reader = _reader(root / "mxfp4")
    assert reader.stores(name) and reader.file_of(name) == "model-00001-of-00002.safetensors"
    shape = tuple(dequantized[name].shape)
    for expert in range(shape[0]):
        assert torch.equal(reader.row(name, shape, expert), dequantized[name][expert])
    reference = _reference(_stored(root / "mxfp4", name + "_blocks"), _stored(root / "mxfp4", name + "_scales"),
                           torch.bfloat16)
    assert torch.equal(reader.full(name, shape).bfloat16(), reference)


def test_transformers_own_mxfp4_load_gives_the_same_experts(checkpoints):
    """A second reference: transformers reads the same checkpoint (``Mxfp4Config(dequantize=True)``, bf16
    experts on CPU; the logits are not compared, as its experts then compute in bf16)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    root, _, dequantized = checkpoints
    model = AutoModelForCausalLM.from_pretrained(str(root / "mxfp4"), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    for name in EXPERTS:
        layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        loaded = getattr(model.model.layers[layer].mlp.experts, proj)
        assert torch.equal(loaded, dequantized[name].to(loaded.dtype)), name


def test_a_row_reads_only_its_experts_blocks_and_scales(checkpoints, monkeypatch):
    root, _, dequantized = checkpoints
    reads, real_open = [], mxfp4.safe_open

    class Recording:
        def __init__(self, path, framework):
            self.inner = real_open(path, framework=framework)

        def get_slice(self, name):
            inner = self.inner.get_slice(name)

            class Slice:
                get_shape, get_dtype = inner.get_shape, inner.get_dtype

                def __getitem__(self, index):
                    reads.append((name, index))
                    return inner[index]

            return Slice()

    monkeypatch.setattr(mxfp4, "safe_open", Recording)
    name = EXPERTS[0]
    reader = _reader(root / "mxfp4")
    for _ in ("gate", "up"):  # the loader asks for an expert's row once for each part
        assert torch.equal(reader.row(name, tuple(dequantized[name].shape), 5), dequantized[name][5])
    assert reads == [(name + "_blocks", slice(5, 6)), (name + "_scales", slice(5, 6))]


def test_model_from_mxfp4_equals_the_dequantised_checkpoint_and_transformers(world, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl.models import save_hf_checkpoint

    root, _, dequantized = checkpoints
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        [model] = build_model(root / "mxfp4", ParallelLayout())
        logits = model.eval()(input_ids, positions, None)
        [plain] = build_model(root / "dequant", ParallelLayout())
        expected = plain.eval()(input_ids, positions, None)
        hf = AutoModelForCausalLM.from_pretrained(str(root / "dequant"), dtype=torch.float32,
                                                  attn_implementation="eager").eval()(input_ids).logits
    assert torch.equal(logits, expected)
    assert (logits - hf).abs().max() <= TOLERANCE
    save_hf_checkpoint([model], root / "mxfp4", ParallelLayout(), tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == dequantized.keys()
    assert all(torch.equal(exported[name], dequantized[name]) for name in dequantized)


def test_dequantized_tensors_give_the_reference_checkpoint(checkpoints):
    """``conversion verify`` builds transformers' model from these."""
    from megarl.models.fp8 import dequantized_tensors

    root, _, dequantized = checkpoints
    tensors = dict(dequantized_tensors(root / "mxfp4"))
    assert tensors.keys() == dequantized.keys()
    assert all(torch.equal(tensors[name].to(dequantized[name].dtype), dequantized[name]) for name in dequantized)


def test_verify_reference_is_transformers_on_the_dequantised_weights(checkpoints):
    """``conversion verify``'s HF side for an MXFP4 checkpoint."""
    from transformers import AutoModelForCausalLM

    from conversion.verify import hf_model

    root, _, _ = checkpoints
    input_ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        logits = hf_model(root / "mxfp4").eval()(input_ids).logits
        reference = AutoModelForCausalLM.from_pretrained(str(root / "dequant"), dtype=torch.float32,
                                                         attn_implementation="eager")(input_ids).logits
    assert torch.equal(logits, reference)


def _gpt_oss(quantization):
    from megarl.devtools.tiny_model import build_config

    config = build_config("gpt_oss", "tiny")
    config.quantization_config = quantization
    return config


def test_published_quantization_config_is_read():
    from megarl.models.fp8 import block_fp8, checkpoint_quantization

    expected = mxfp4.MXFP4(tuple(QUANTIZATION["modules_to_not_convert"]))
    assert mxfp4.mxfp4_experts(_gpt_oss(QUANTIZATION)) == expected
    assert mxfp4.mxfp4_experts(_gpt_oss({**QUANTIZATION, "dequantize": True})) == expected  # transformers' own option
    assert checkpoint_quantization(_gpt_oss(QUANTIZATION)) == expected and block_fp8(_gpt_oss(QUANTIZATION)) is None
    assert mxfp4.mxfp4_experts(_gpt_oss(None)) is None


@pytest.mark.parametrize("quantization, field", [
    ({**QUANTIZATION, "bits": 4}, "bits"),
    ({**QUANTIZATION, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ({**QUANTIZATION, "dequantize": "yes"}, "dequantize"),
])
def test_unknown_fields_and_values_are_refused_naming_the_field(quantization, field):
    with pytest.raises(ValueError, match=rf"quantization_config\.{field}=.* is not supported"):
        mxfp4.mxfp4_experts(_gpt_oss(quantization))


def test_mxfp4_of_another_family_is_refused():
    from transformers import LlamaConfig

    from megarl.models.fp8 import checkpoint_quantization

    with pytest.raises(ValueError, match="quant_method='mxfp4' is not supported: .*gpt-oss .* a llama checkpoint"):
        checkpoint_quantization(LlamaConfig(quantization_config=QUANTIZATION))


def test_blocks_without_scales_or_without_config_are_refused(checkpoints, tmp_path):
    root, _, _ = checkpoints
    name = EXPERTS[1]
    files = {k: v for k, v in checkpoint_files(root / "mxfp4").items() if k != name + "_scales"}
    with pytest.raises(KeyError, match=rf"{name}_blocks is in the checkpoint at .* but its scales {name}_scales"):
        mxfp4.ExpertReader(root / "mxfp4", files, mxfp4.MXFP4()).stores(name)
    with pytest.raises(ValueError, match=rf"{name}_blocks holds MXFP4 blocks but .*config.json declares no"):
        _reader(root / "mxfp4", None).stores(name)


def test_loader_refuses_a_checkpoint_missing_scales(world, checkpoints, tmp_path):
    root, _, _ = checkpoints
    shutil.copytree(root / "mxfp4", tmp_path / "broken")
    index = json.loads((tmp_path / "broken" / "model.safetensors.index.json").read_text())
    del index["weight_map"][EXPERTS[2] + "_scales"]
    (tmp_path / "broken" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match=f"but its scales {EXPERTS[2]}_scales are not"):
        build_model(tmp_path / "broken", ParallelLayout())


def test_an_mxfp4_model_path_is_a_config_problem(checkpoints, tmp_path):
    """As an FP8 one (tests/models/test_fp8.py): the fleet would serve it quantised; the problem names the
    conversion that makes a bf16 copy."""
    from megarl.checks import ConfigError, load_config
    from tests.config._fixtures import write_prompts
    from tests.config.test_preflight import BATCH

    root, _, _ = checkpoints
    data = write_prompts(tmp_path / "train.parquet", rows=8)
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BATCH, f"actor_rollout_ref.model.path={root / 'mxfp4'}", f"data.train_files={data}"],
                    preflight=True)
    (problem,) = [p for p in info.value.problems if p.key == "actor_rollout_ref.model.path"]
    assert "is MXFP4-quantised: " in problem.message and "megatron-to-hf --checkpoint MCORE" in problem.message
