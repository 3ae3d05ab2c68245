"""The qwen3_next family without processes: dims, megatron fields, names, the gated QKV, refusals; and that
the tiny model's features act (a bridge that dropped one would still match HF if it did not).

The HF-logits and export tests live with the other families (test_bridge_tp1.py, test_bridge_distributed.py).
"""
import pytest
import torch

from megarl.devtools.tiny_model import build_config
from megarl.models import ParallelLayout, model_dims, param_shards, rank_shards, vllm_splits
from megarl.models.config import gpt_model_kwargs, transformer_config_kwargs
from megarl.models.families import family_for
from megarl.models.shards import check_layout


def tiny():
    return build_config("qwen3_next", "tiny")


def test_dims_read_the_hybrid_pattern_deltanet_heads_and_moe():
    dims = model_dims(tiny())
    a = dims.attention
    assert a.full == (False, True, False, False) and a.qk_norm
    assert (a.key_heads, a.value_heads, a.key_head_dim, a.value_head_dim, a.conv_kernel) == (2, 4, 32, 32, 4)
    assert dims.moe.layers == (True, True, False, True) and dims.moe.shared_expert_ffn_hidden_size == 64
    assert dims.rotary_percent == 0.25


def test_megatron_config_fields():
    dims = model_dims(tiny())
    kwargs = transformer_config_kwargs(dims, family_for(tiny()), ParallelLayout(ep=2))
    expected = dict(attention_output_gate=True, qk_layernorm=True, moe_shared_expert_gate=True,
                    moe_shared_expert_intermediate_size=64, moe_router_pre_softmax=False, moe_layer_freq=[1, 1, 0, 1])
    assert {k: kwargs[k] for k in expected} == expected
    assert gpt_model_kwargs(dims, ParallelLayout(), "actor")["rotary_percent"] == 0.25


def test_names_of_deltanet_gated_attention_and_shared_expert_gate():
    specs = {s.name: s.pieces[0].hf_name for s in param_shards(tiny(), ParallelLayout()) if s.pieces}
    assert specs["decoder.layers.0.self_attention.in_proj_qkvz.weight"] == "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert specs["decoder.layers.3.self_attention.A_log"] == "model.layers.3.linear_attn.A_log"
    assert specs["decoder.layers.1.self_attention.q_layernorm.weight"] == "model.layers.1.self_attn.q_norm.weight"
    assert specs["decoder.layers.0.mlp.shared_experts.gate_weight"] == "model.layers.0.mlp.shared_expert_gate.weight"
    assert specs["decoder.layers.2.mlp.linear_fc2.weight"] == "model.layers.2.mlp.down_proj.weight"


def test_gated_qkv_by_hand():
    """4 heads in 2 groups, head_dim 32: q_proj holds [q_h; gate_h] per head (64 rows each); megatron's
    group g is [q of heads 2g, 2g+1; their gates; k_g; v_g]."""
    [spec] = [s for s in rank_shards(tiny(), ParallelLayout(), 0, 0) if s.name == "decoder.layers.1.self_attention.linear_qkv.weight"]
    rows = [(p.hf_name.rsplit(".", 2)[-2], p.hf_slice[0].start, p.hf_slice[0].stop) for p in spec.pieces]
    assert rows[:6] == [("q_proj", 0, 32), ("q_proj", 64, 96), ("q_proj", 32, 64), ("q_proj", 96, 128),
                        ("k_proj", 0, 32), ("v_proj", 0, 32)]
    assert rows[6:8] == [("q_proj", 128, 160), ("q_proj", 192, 224)] and spec.local_shape == (2 * (128 + 64), 128)


def test_tensor_parallelism_splits_the_deltanet_by_key_heads_and_refuses_a_split_inside_one():
    """2 key heads of 32, 4 value heads of 32: at TP=2 rank 1 holds key head 1 with value heads 2 and 3. Its
    ``conv1d_grouped`` rows are that group's q, k and v rows of HF's flat [q; k; v] ``conv1d``; the fused
    ``in_proj_qkvz`` is per key head already (a plain split), ``out_proj`` splits its input columns."""
    check_layout(model_dims(tiny()), ParallelLayout(tp=2))
    with pytest.raises(ValueError, match="linear_num_key_heads=2 does not divide by 4"):
        check_layout(model_dims(tiny()), ParallelLayout(tp=4))
    shards = {s.name.split("self_attention.")[-1]: s for s in rank_shards(tiny(), ParallelLayout(tp=2), 0, 1)
              if s.name.startswith("decoder.layers.0.self_attention.")}
    conv = shards["conv1d_grouped.weight"]
    assert [(p.hf_name.rsplit(".", 2)[-2], p.hf_slice[0].start, p.hf_slice[0].stop) for p in conv.pieces] == [
        ("conv1d", 32, 64), ("conv1d", 96, 128), ("conv1d", 192, 256)] and conv.local_shape == (128, 1, 4)
    [qkvz] = shards["in_proj_qkvz.weight"].pieces
    assert (qkvz.hf_slice[0].start, qkvz.hf_slice[0].stop) == (192, 384)  # one key head: 32 + 32 + 2 * 32 + 2 * 32
    [out] = shards["out_proj.weight"].pieces
    assert (out.hf_slice[1].start, out.hf_slice[1].stop) == (64, 128)
    assert [p.hf_slice[0] for p in shards["A_log"].pieces] == [slice(2, 4)]


def test_the_vllm_split_plan_splits_the_deltanet_by_heads_and_vllm_cpu_is_refused_with_the_reason():
    from megarl.models import vllm_cpu_refusal, vllm_tp_problems

    splits = vllm_splits(tiny())  # tests/models/test_vllm_delta_net_splits.py checks it against vLLM's loaders
    kinds = {name.split(".", 3)[3]: split.kind for name, split in splits.items() if name.startswith("model.layers.0.")}
    assert kinds["linear_attn.in_proj_qkvz.weight"] == "column" and kinds["linear_attn.conv1d.weight"] == "whole"
    assert kinds["linear_attn.out_proj.weight"] == "row" and kinds["linear_attn.norm.weight"] == "replicated"
    assert "requires BF16" in vllm_cpu_refusal(tiny()) and "rollout.name=hf" in vllm_cpu_refusal(tiny())
    assert vllm_cpu_refusal(tiny(), "bfloat16") is None
    assert vllm_tp_problems(model_dims(tiny()), 2) == []
    assert any("linear_num_key_heads=2 is not divisible by tp=4" in p for p in vllm_tp_problems(model_dims(tiny()), 4))


def test_mtp_tensors_are_skipped_by_name():
    pattern = family_for(tiny()).skipped_hf_tensors(tiny())
    assert pattern.match("mtp.layers.0.input_layernorm.weight") and not pattern.match("model.layers.0.mlp.gate.weight")


def _with(**fields):
    config = tiny()
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("fields, message", [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
     "layer_types=\\['sliding_attention'\\]"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.25,
                          "original_max_position_embeddings": 64}}, "yarn"),
])
def test_unsupported_variants_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        model_dims(_with(**fields))


def _logits_with(model_zoo, suffix=None, **change):
    from transformers import AutoModelForCausalLM

    reference = torch.load(model_zoo / "reference.pt")["qwen3_next"]
    model = AutoModelForCausalLM.from_pretrained(str(model_zoo / "qwen3_next"), dtype=torch.float32,
                                                 attn_implementation="eager", **change).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if suffix and name.endswith(suffix):
                param.zero_()
        return (model(reference["input_ids"]).logits - reference["output"]).abs().max().item()


@pytest.mark.parametrize("suffix", ["shared_expert_gate.weight", "linear_attn.dt_bias", "linear_attn.A_log",
                                    "linear_attn.norm.weight", "self_attn.q_norm.weight", "conv1d.weight"])
def test_each_tiny_feature_changes_the_reference_logits(model_zoo, suffix):
    """Zeroing each feature's tensor moves transformers' own logits by far more than the bridge's 1e-5."""
    assert _logits_with(model_zoo, suffix) > 1e-3


def test_partial_rope_changes_the_reference_logits(model_zoo):
    full = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    assert _logits_with(model_zoo, rope_parameters=full) > 1e-3
