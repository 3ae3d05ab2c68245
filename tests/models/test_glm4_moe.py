"""The glm4_moe family (GLM-4.5 / 4.6) without processes: dims, megatron fields, names, vLLM splits,
refusals; and that the tiny model's features act (a bridge that dropped one would still match HF if
it did not).

The HF-logits and export tests live with the other families (test_bridge_tp1.py, test_bridge_distributed.py).
"""
import pytest
import torch

from megarl.devtools.tiny_model import build_config
from megarl.models import ParallelLayout, model_dims, param_shards, vllm_splits
from megarl.models.config import gpt_model_kwargs, transformer_config_kwargs
from megarl.models.families import family_for


def tiny():
    return build_config("glm4_moe", "tiny")


def test_dims_read_partial_rope_bias_qk_norm_and_grouped_sigmoid_routing():
    dims = model_dims(tiny())
    a, moe = dims.attention, dims.moe
    assert (a.qkv_bias, a.qk_norm, dims.rotary_percent) == (True, True, 0.5)
    assert moe.layers == (False, True) and moe.score_function == "sigmoid" and moe.expert_bias
    assert (moe.num_experts, moe.num_groups, moe.group_topk, moe.topk, moe.scaling_factor) == (8, 2, 1, 2, 2.5)
    assert moe.shared_expert_ffn_hidden_size == 64


def test_megatron_config_fields():
    dims = model_dims(tiny())
    kwargs = transformer_config_kwargs(dims, family_for(tiny()), ParallelLayout(ep=2))
    expected = dict(add_qkv_bias=True, qk_layernorm=True, moe_router_score_function="sigmoid",
                    moe_router_pre_softmax=False, moe_router_enable_expert_bias=True, moe_router_num_groups=2,
                    moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
                    moe_shared_expert_intermediate_size=64, moe_layer_freq=[0, 1], num_moe_experts=8, moe_router_topk=2)
    assert {k: kwargs[k] for k in expected} == expected
    assert gpt_model_kwargs(dims, ParallelLayout(), "actor")["rotary_percent"] == 0.5


def test_names_of_the_router_bias_shared_expert_and_dense_layer():
    specs = {s.name: s.pieces[0].hf_name for s in param_shards(tiny(), ParallelLayout()) if s.pieces}
    assert specs["decoder.layers.1.mlp.router.expert_bias"] == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert specs["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"] == "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert specs["decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"] == "model.layers.1.mlp.experts.7.down_proj.weight"
    assert specs["decoder.layers.0.mlp.linear_fc2.weight"] == "model.layers.0.mlp.down_proj.weight"
    splits = vllm_splits(tiny())
    assert splits["model.layers.1.self_attn.q_norm.weight"].kind == "replicated"
    assert splits["model.layers.1.self_attn.k_proj.bias"].kind == "kv_heads"


def test_real_glm45_air_shape_reads():
    config = tiny()
    config.update(dict(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128, num_hidden_layers=46,
                       n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                       moe_intermediate_size=1408, routed_scaling_factor=1.0, use_qk_norm=False))
    dims = model_dims(config)
    assert dims.moe.num_groups is None and dims.moe.layers[:2] == (False, True) and dims.rotary_percent == 0.5


def _with(**fields):
    config = tiny()
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("fields, message", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"num_experts_per_tok": 4}, "num_experts_per_tok / topk_group='4/1'"),
    ({"n_group": 3}, "n_group=3"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "partial_rotary_factor": 0.5}}, "yarn"),
])
def test_unsupported_variants_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        model_dims(_with(**fields))


@pytest.mark.parametrize("change", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 1.0}},
    {"use_qk_norm": False},
    {"n_group": 1, "topk_group": 1},
    {"routed_scaling_factor": 1.0},
])
def test_each_tiny_feature_changes_the_reference_logits(model_zoo, change):
    """Without the feature, transformers' own logits move by far more than the bridge's 1e-5 tolerance."""
    from transformers import AutoModelForCausalLM

    reference = torch.load(model_zoo / "reference.pt")["glm4_moe"]
    model = AutoModelForCausalLM.from_pretrained(str(model_zoo / "glm4_moe"), dtype=torch.float32,
                                                 attn_implementation="eager", **change).eval()
    with torch.no_grad():
        changed = model(reference["input_ids"]).logits
    assert (changed - reference["output"]).abs().max().item() > 1e-3
