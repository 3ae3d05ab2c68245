"""HF -> megatron (TP=2, PP=2, EP=2 under torchrun) -> HF (TP=1, or EP=2) reproduces every tensor bit for bit.

The vision-language families (Qwen2.5-VL at TP=2, Qwen3-VL at PP=2) carry their vision towers (replicated on
the first stage's TP ranks in megatron) through both ways, and their processor files.

The reference is the original safetensors files read with ``safetensors`` directly; the tiny
fixtures give every norm and bias its own noise, so a swapped or dropped tensor is caught. The
written checkpoint must also load in transformers and give the original model's logits.
"""
import json

import pytest
import torch
from safetensors import safe_open

from tests.conversion.conftest import assert_ok, run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]  # a setup: the tiny models and two conversions

# (name, family, layout flags there, processes there, layout flags back, processes back)
SCENARIOS = [
    ("llama_tp2", "llama", ["--tp", "2"], 2, [], 1),
    ("llama_pp2", "llama", ["--pp", "2"], 2, [], 1),
    ("qwen3_moe_ep2", "qwen3_moe", ["--ep", "2"], 2, [], 1),
    ("mixtral_ep2_back", "mixtral", [], 1, ["--ep", "2"], 2),
    ("deepseek_v3_ep2", "deepseek_v3", ["--ep", "2"], 2, [], 1),
    ("qwen2_5_vl_tp2", "qwen2_5_vl", ["--tp", "2"], 2, [], 1),
    ("qwen3_vl_pp2", "qwen3_vl", ["--pp", "2"], 2, [], 1),
]
VISION = {"qwen2_5_vl": "visual.", "qwen3_vl": "model.visual."}  # the towers' HF prefixes
MTP = "model.layers.3."  # DeepSeek-V3's multi-token-prediction layer: not converted, copied from --hf-config (docs/conversion.md)


def read_all(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.fixture(scope="module", params=SCENARIOS, ids=[s[0] for s in SCENARIOS])
def round_trip(request, tiny_models, to_megatron, tmp_path_factory):
    name, family, there, n_there, back, n_back = request.param
    work = tmp_path_factory.mktemp(name)
    source = tiny_models / family
    mcore = to_megatron(family, tuple(there), n_there)
    assert not mcore.with_name("mcore.tmp").exists()
    assert_ok(run_cli(["megatron-to-hf", "--checkpoint", mcore, "--hf-config", source,
                       "--out", work / "hf", "--max-shard-size", "200000", *back], n_back))
    return family, source, work


def test_every_tensor_is_reproduced_bit_for_bit(round_trip):
    family, source, work = round_trip
    original, converted = read_all(source), read_all(work / "hf")
    if family == "deepseek_v3":  # the MTP layer, which the megatron checkpoint lacks, is written whole too
        assert sum(name.startswith(MTP) for name in original) == 4
    assert sorted(converted) == sorted(original)
    if family in VISION:
        assert sum(name.startswith(VISION[family]) for name in converted) > 10
    for name, tensor in original.items():
        assert converted[name].dtype == tensor.dtype, name
        assert torch.equal(converted[name], tensor), name


def test_output_is_sharded_with_an_index_and_tokenizer(round_trip):
    _, source, work = round_trip
    out = work / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    if (source / "preprocessor_config.json").is_file():  # a VL model's processor comes along
        assert (out / "preprocessor_config.json").read_text() == (source / "preprocessor_config.json").read_text()
    assert not (work / "hf.tmp").exists()


def test_expert_tensors_use_hugging_face_names(round_trip):
    family, _, work = round_trip
    names = set(json.loads((work / "hf" / "model.safetensors.index.json").read_text())["weight_map"])
    expected = {
        "qwen3_moe": "model.layers.1.mlp.experts.3.gate_proj.weight",
        "mixtral": "model.layers.1.block_sparse_moe.experts.3.w1.weight",
        "deepseek_v3": "model.layers.2.mlp.experts.15.down_proj.weight",
    }
    if family in expected:
        assert expected[family] in names
    if family == "deepseek_v3":  # the fields vLLM routes by (transformers drops them) survive the export
        config = json.loads((work / "hf" / "config.json").read_text())
        assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names


def test_transformers_loads_the_output(round_trip):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from conversion.verify_inputs import verify_batch

    family, source, work = round_trip
    if family in VISION:  # the VL model class, on an image row (the tower's weights count)
        inputs = verify_batch(source, ["Hello there"])
        ids, extra, auto = inputs.input_ids, inputs.hf_kwargs(), AutoModelForImageTextToText
    else:
        ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
        extra, auto = {}, AutoModelForCausalLM
    with torch.no_grad():
        reference = auto.from_pretrained(str(source), dtype=torch.float32)(ids, **extra).logits
        converted = auto.from_pretrained(str(work / "hf"), dtype=torch.float32)(ids, **extra).logits
    assert torch.equal(reference, converted)
