"""The bridge at TP=2 (with and without SP), PP=2, PP=2 x VPP=2, EP=2 and expert-TP=2: one torchrun launch, 2 ranks.

Gemma-2 and Gemma-3 (their own decoder layers: four norms, windows, soft-caps, two RoPEs) run at
TP=2, TP=2+SP and PP=2; GLM-4.5 (partial RoPE, QKV bias, qk-norm, group-limited sigmoid routing)
at TP=2+SP, PP=2, EP=2 (alltoall, allgather) and TP=2 x EP=2 + SP; Kimi-K2 at TP=2+SP and EP=2; gpt-oss (sinks, biases, windows, packed experts) at TP=2+SP, PP=2 and EP=2; Qwen3-Next (gated DeltaNet and gated attention) at TP=2, TP=2+SP, PP=2 and EP=2; Qwen3.5 at TP=2+SP and PP=2, Qwen3.5-MoE at PP=2 and EP=2. DeepSeek-V3 (MLA, sigmoid group-limited routing with the router bias, shared expert, a dense first
layer) runs at TP=2+SP, uneven PP=2 (1+2 and 2+1 layers), EP=2 (alltoall and allgather),
TP=2 x EP=2 and TP=2 x expert-TP=2; a padded vocabulary (504 -> 512) at TP=2.

The worker (``_dist_worker.py``) runs every scenario and records measurements; the tests here
compare them with Hugging Face transformers (logits within 1e-5 in fp32), with the original
safetensors (export bit for bit) and with the checkpoint index (files and elements read).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.models.two_ranks import rank_records, run_two_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(480)]

WORKER = Path(__file__).with_name("_dist_worker.py")
TOLERANCE = 1e-5
FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
MOE = ["qwen3_moe", "mixtral"]
FORWARD_SCENARIOS = (
    [f"{f}/{layout}" for f in FAMILIES for layout in ("tp2", "tp2_sp", "pp2")]
    + [f"{f}/{layout}" for f in MOE for layout in ("ep2", "tp2_ep2_sp")]
    + ["mixtral/ep2_allgather", "mixtral/tp2_etp2", "llama_tied/tp2", "llama_tied/pp2", "llama_small/pp2_vpp2"]
    + ["llama_sharded/pp2", "llama_sharded/tp2", "llama_critic/tp2_sp", "llama_critic/pp2"]
    + ["llama_vocab504/tp2", "llama_vocab504/tp2_sp"]
    + [f"deepseek_v3/{layout}" for layout in ("tp2_sp", "pp2_1_2", "pp2_2_1", "ep2", "ep2_allgather", "tp2_ep2_sp", "tp2_etp2_sp")]
    + [f"{f}/{layout}" for f in ("gemma2", "gemma3") for layout in ("tp2", "tp2_sp", "pp2")]
    + [f"glm4_moe/{layout}" for layout in ("tp2_sp", "pp2", "ep2", "ep2_allgather", "tp2_ep2_sp")]
    + ["kimi_k2/tp2_sp", "kimi_k2/ep2"] + [f"gpt_oss/{layout}" for layout in ("tp2_sp", "pp2", "ep2")]
    + ["qwen3_next/tp2", "qwen3_next/tp2_sp", "qwen3_next/pp2", "qwen3_next/ep2"]
    + ["qwen3_5/tp2_sp", "qwen3_5/pp2", "qwen3_5_moe/pp2", "qwen3_5_moe/ep2"]
)
EXPORT_SCENARIOS = (
    [f"{f}/{layout}" for f in FAMILIES for layout in ("tp2", "pp2")]
    + [f"{f}/ep2" for f in MOE]
    + ["mixtral/tp2_etp2", "llama_tied/tp2", "llama_tied/pp2", "llama_small/pp2_vpp2", "llama_critic/tp2_sp"]
    + ["llama_vocab504/tp2"] + [f"deepseek_v3/{layout}" for layout in ("tp2_sp", "pp2_1_2", "ep2", "tp2_etp2_sp")]
    + [f"{f}/{layout}" for f in ("gemma2", "gemma3") for layout in ("tp2", "pp2")]
    + [f"glm4_moe/{layout}" for layout in ("tp2_sp", "pp2", "ep2")] + ["kimi_k2/tp2_sp", "kimi_k2/ep2"]
    + [f"gpt_oss/{layout}" for layout in ("tp2_sp", "pp2", "ep2")] + ["qwen3_next/tp2", "qwen3_next/pp2", "qwen3_next/ep2"]
    + ["qwen3_5/tp2_sp", "qwen3_5/pp2", "qwen3_5_moe/pp2", "qwen3_5_moe/ep2"]
)


@pytest.fixture(scope="module")
def results(model_zoo):
    return run_two_ranks(WORKER, model_zoo, "results.json", timeout=450)


@pytest.mark.parametrize("scenario", FORWARD_SCENARIOS)
def test_outputs_match_hugging_face(results, scenario):
    records = [r for r in rank_records(results, scenario) if "max_diff" in r]
    assert records, f"{scenario}: no rank produced outputs"
    for record in records:
        assert record["max_diff"] <= TOLERANCE, f"{scenario} rank {record['rank']}: max |megatron - HF| = {record['max_diff']}"


def test_tensor_parallel_ranks_hold_half_the_vocab(results):
    for record in rank_records(results, "llama/tp2"):
        assert record["output_shape"] == [2, 16, 256]  # vocab 512 over TP=2
    values = rank_records(results, "llama_critic/tp2_sp")
    assert all(r["output_shape"] == [2, 16, 1] for r in values)


def test_padded_vocabulary_is_masked_on_the_rank_that_holds_it(results):
    """504 rows padded to 512 at TP=2: rank 1 holds 248 real columns and 8 padding columns at -inf."""
    for scenario in ("llama_vocab504/tp2", "llama_vocab504/tp2_sp"):
        by_rank = {r["tp_rank"]: r for r in rank_records(results, scenario)}
        assert (by_rank[0]["padding_columns"], by_rank[1]["padding_columns"]) == (0, 8)
        assert by_rank[1]["padding_masked"] and by_rank[1]["output_shape"] == [2, 16, 248]


def test_deepseek_v3_uneven_pipeline_stages(results):
    """3 layers as 1 + 2 and as 2 + 1: the loads read only each stage's layers."""
    for scenario, first_stage in (("deepseek_v3/pp2_1_2", {0}), ("deepseek_v3/pp2_2_1", {0, 1})):
        stages = {r["pp_rank"]: r for r in rank_records(results, scenario)}
        layers = {int(name.split(".")[2]) for name in stages[0]["reads"]["tensors"] if name.startswith("model.layers.")}
        assert layers == first_stage, scenario
        assert "max_diff" in stages[1] and "max_diff" not in stages[0]


def test_pipeline_outputs_only_on_the_last_stage(results):
    stages = {r["pp_rank"]: ("max_diff" in r) for r in rank_records(results, "llama/pp2")}
    assert stages == {0: False, 1: True}


@pytest.mark.parametrize("scenario", EXPORT_SCENARIOS)
def test_export_reproduces_the_checkpoint_bit_for_bit(results, scenario):
    export = rank_records(results, scenario)[0]["export"]
    assert export == {"missing": [], "extra": [], "mismatched": []}


def _index(checkpoint: Path) -> dict[str, str]:
    return json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]


def _numel(checkpoint: Path, names) -> int:
    total = 0
    weight_map = _index(checkpoint)
    for name in names:
        with safe_open(str(checkpoint / weight_map[name]), framework="pt") as f:
            total += torch.Size(f.get_slice(name).get_shape()).numel()
    return total


def test_pipeline_stage_opens_only_files_with_its_tensors(results, model_zoo):
    checkpoint = model_zoo / "llama_sharded"
    weight_map = _index(checkpoint)
    assert len(set(weight_map.values())) >= 4, "the fixture should spread the weights over several files"
    # 2 layers over 2 stages: stage 0 = embedding + layer 0; stage 1 = layer 1 + final norm + lm_head.
    stage_tensors = {
        0: [n for n in weight_map if n == "model.embed_tokens.weight" or n.startswith("model.layers.0.")],
        1: [n for n in weight_map if n in ("model.norm.weight", "lm_head.weight") or n.startswith("model.layers.1.")],
    }
    for record in rank_records(results, "llama_sharded/pp2"):
        names = stage_tensors[record["pp_rank"]]
        assert sorted(record["reads"]["files"]) == sorted({weight_map[n] for n in names})
        assert sorted(set(record["reads"]["tensors"])) == sorted(names)  # fused QKV reads q/k/v once per group
        assert record["reads"]["elements"] == _numel(checkpoint, names)
    files_per_stage = [set(r["reads"]["files"]) for r in rank_records(results, "llama_sharded/pp2")]
    assert files_per_stage[0] != files_per_stage[1]


def test_tensor_parallel_rank_reads_only_its_rows(results, model_zoo):
    checkpoint = model_zoo / "llama_sharded"
    weight_map = _index(checkpoint)
    norms = [n for n in weight_map if n.endswith("norm.weight")]
    split = [n for n in weight_map if n not in norms]
    expected = _numel(checkpoint, norms) + _numel(checkpoint, split) // 2
    for record in rank_records(results, "llama_sharded/tp2"):
        assert record["reads"]["elements"] == expected


def test_saved_checkpoint_loads_in_transformers(results, model_zoo):
    from transformers import AutoModelForCausalLM

    rank_records(results, "llama_sharded/pp2")
    saved = model_zoo / "saved" / "llama_sharded_pp2"
    original = model_zoo / "llama_sharded"
    assert len(list(saved.glob("*.safetensors"))) > 1 and (saved / "model.safetensors.index.json").is_file()
    saved_map, original_map = _index(saved), _index(original)
    assert sorted(saved_map) == sorted(original_map)
    for name in original_map:
        with safe_open(str(saved / saved_map[name]), framework="pt") as a, safe_open(str(original / original_map[name]), framework="pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    reference = torch.load(model_zoo / "reference.pt")["llama_sharded"]
    model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    assert torch.equal(logits, reference["output"])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("layout", ["tp2_grads_save", "tp2_sp_grads"])
def test_gated_deltanet_gradients_at_tp2_equal_tp1(results, model_zoo, family, layout):
    """One backward at TP=1 and at TP=2 (with and without SP), gathered by HF name after the sums training does
    over ranks: every gradient agrees within 1e-4 of its tensor's largest (the DeltaNet's A_log and dt_bias have
    gradients near 1e-8: measured within 6e-4 of them, 1e-11 absolute). A TP=2 DeltaNet that dropped the sum of its
    heads' input gradients was off by half in the layer norm feeding it."""
    for scenario in (f"{family}/tp1_grads", f"{family}/{layout}"):
        rank_records(results, scenario)
    tp1 = torch.load(model_zoo / f"grads_{family}_tp1_grads.pt")
    tp2 = torch.load(model_zoo / f"grads_{family}_{layout}.pt")
    assert sorted(tp1) == sorted(tp2) and any("linear_attn.conv1d" in name for name in tp1)
    for name, expected in tp1.items():
        assert expected.abs().max() > 0, name
        error = (tp2[name] - expected).abs().max().item()
        assert error <= 1e-4 * expected.abs().max().item() + 1e-9, (name, error, expected.abs().max().item())


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_tp2_distributed_checkpoint_of_the_deltanet_loads_at_tp1(results, family):
    """Weights moved at TP=2 and saved as a distributed checkpoint (megarl's format; keyed per layer, as the DeltaNet
    is in some layers only) load at TP=1 and gather to the same tensors, bit for bit."""
    record = rank_records(results, f"{family}/tp1_load")[0]
    assert record["load_mismatched"] == [] and record["load_changed"] > 0, record
