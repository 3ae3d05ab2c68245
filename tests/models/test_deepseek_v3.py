"""The deepseek_v3 family without processes: its maps, its megatron config, vLLM's splits, the refusals.

The HF-logits tests live with the other families (test_bridge_tp1.py, test_bridge_distributed.py).
"""
import pytest

from megarl.models import ParallelLayout, model_dims, param_shards, rank_shards, vllm_splits
from megarl.models.config import transformer_config_kwargs
from megarl.models.families import family_for
from megarl.devtools.tiny_model import build_config
from tests.models.test_shards import _box, check_layout_exact, deepseek_v3

P = "model.layers.1.self_attn."


def tiny():
    return build_config("deepseek_v3", "tiny")


def test_dims_read_mla_yarn_and_deepseek_moe():
    dims = model_dims(tiny())
    a, moe, rope = dims.attention, dims.moe, dims.rope
    assert (a.num_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (4, 96, 512, 32, 64, 32)
    assert moe.layers == (False, True, True) and moe.score_function == "sigmoid" and moe.expert_bias
    assert (moe.num_experts, moe.num_groups, moe.group_topk, moe.topk, moe.scaling_factor) == (16, 4, 2, 4, 2.5)
    assert moe.shared_expert_ffn_hidden_size == 32
    assert (rope.factor, rope.original_max_position_embeddings, rope.mscale, rope.mscale_all_dim) == (32.0, 64, 1.0, 1.0)


def test_megatron_config_fields():
    dims = model_dims(tiny())
    kwargs = transformer_config_kwargs(dims, family_for(tiny()), ParallelLayout(ep=2))
    assert family_for(tiny()).config_class == "MLATransformerConfig"
    expected = dict(multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=512, qk_head_dim=32, qk_pos_emb_head_dim=64,
                    v_head_dim=32, kv_channels=32, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=32.0,
                    original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                    moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
                    moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1], num_moe_experts=16,
                    moe_router_topk=4, expert_model_parallel_size=2)
    assert {k: kwargs[k] for k in expected} == expected


def test_layer_names_and_the_router_bias_buffer():
    specs = {s.name: s for s in rank_shards(tiny(), ParallelLayout(tp=2, ep=2), pp_stage=0, tp_rank=1, ep_rank=1)}
    attention = {n.split("self_attention.")[1]: s.local_shape for n, s in specs.items() if n.startswith("decoder.layers.1.self_attention")}
    assert attention == {"linear_q_down_proj.weight": (48, 128), "q_layernorm.weight": (96,),
                         "linear_q_up_proj.weight": (2 * 96, 96), "linear_kv_down_proj.weight": (288, 128),
                         "kv_layernorm.weight": (512,), "linear_kv_up_proj.weight": (2 * 64, 512),
                         "linear_proj.weight": (128, 2 * 32)}
    bias = specs["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.buffer and bias.split_dim is None and bias.pieces[0].hf_name == "model.layers.1.mlp.gate.e_score_correction_bias"
    # q_b_proj / kv_b_proj rows are whole heads: TP rank 1 of 2 holds heads 2 and 3.
    q_up = specs["decoder.layers.1.self_attention.linear_q_up_proj.weight"].pieces[0]
    assert _box(q_up.hf_slice)[0] == (2 * 96, 4 * 96)
    experts = sorted(int(n.split(".")[6]) for n in specs if ".local_experts." in n and n.endswith("fc1.weight") and n.startswith("decoder.layers.1."))
    assert experts == list(range(8))  # local indices of experts 8..15
    assert "decoder.layers.0.mlp.linear_fc1.weight" in specs and "decoder.layers.1.mlp.shared_experts.linear_fc2.weight" in specs


@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2), ParallelLayout(tp=4, sequence_parallel=True),
                                    ParallelLayout(pp=2, first_stage_layers=1), ParallelLayout(pp=3), ParallelLayout(ep=4),
                                    ParallelLayout(tp=2, ep=2, etp=2), ParallelLayout(tp=2, pp=3, ep=8)])
def test_every_element_is_covered_once(layout):
    check_layout_exact(tiny(), layout)


def test_transformer_engine_names():
    """TE's MLA spec: latent norms fused into the up-projections, down-projections replicated,
    input_layernorm separate; the dense layer's pre-MLP norm fused into fc1."""
    specs = {s.name: s for s in param_shards(tiny(), ParallelLayout(tp=2), transformer_impl="transformer_engine") if s.tp_rank == 1}
    layer = "decoder.layers.1."
    assert layer + "self_attention.linear_q_up_proj.layer_norm_weight" in specs
    assert layer + "self_attention.linear_kv_up_proj.layer_norm_weight" in specs
    assert layer + "input_layernorm.weight" in specs and layer + "pre_mlp_layernorm.weight" in specs
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in specs
    assert not any("q_layernorm" in n or "kv_layernorm" in n for n in specs)
    down = specs[layer + "self_attention.linear_q_down_proj.weight"]
    assert down.split_dim is None and down.local_shape == (96, 128) and not down.primary  # replicated; rank 0 sends


def test_vllm_splits_follow_its_deepseek_model():
    """vLLM: fused_qkv_a_proj (q_a + kv_a) replicated, q_b / kv_b split by heads, o by columns,
    router and bias replicated, shared and routed experts split like MLPs."""
    splits = {name: split.kind for name, split in vllm_splits(tiny()).items()}
    assert {k: splits[P + k] for k in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_layernorm.weight",
                                       "kv_a_layernorm.weight", "q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")} == {
        "q_a_proj.weight": "replicated", "kv_a_proj_with_mqa.weight": "replicated", "q_a_layernorm.weight": "replicated",
        "kv_a_layernorm.weight": "replicated", "q_b_proj.weight": "column", "kv_b_proj.weight": "column", "o_proj.weight": "row"}
    m = "model.layers.1.mlp."
    assert {splits[m + k] for k in ("gate.weight", "gate.e_score_correction_bias")} == {"replicated"}
    assert [splits[m + k] for k in ("shared_experts.gate_proj.weight", "shared_experts.down_proj.weight",
                                    "experts.7.up_proj.weight", "experts.7.down_proj.weight")] == ["column", "row", "column", "row"]
    assert splits["model.embed_tokens.weight"] == "vocab" and splits["model.layers.0.mlp.down_proj.weight"] == "row"


def test_real_deepseek_v3_reads_and_the_671b_layout_is_exact():
    dims = model_dims(deepseek_v3())
    assert (dims.moe.num_experts, dims.moe.topk, dims.moe.num_groups, dims.moe.group_topk) == (256, 8, 8, 4)
    assert dims.moe.layers[:4] == (False, False, False, True) and dims.rope.factor == 40.0
    assert dims.attention.q_lora_rank == 1536 and dims.moe.shared_expert_ffn_hidden_size == 2048


def test_q_without_a_latent_maps_q_proj():
    config = tiny()
    config.q_lora_rank = None  # DeepSeek-V2-Lite style
    specs = {s.name: s for s in param_shards(config, ParallelLayout(tp=2)) if s.tp_rank == 0}
    q = specs["decoder.layers.0.self_attention.linear_q_proj.weight"]
    assert q.local_shape == (2 * 96, 128) and q.pieces[0].hf_name == "model.layers.0.self_attn.q_proj.weight"
    assert not any("q_down" in n or "q_layernorm" in n for n in specs)
    assert vllm_splits(config)["model.layers.0.self_attn.q_proj.weight"].kind == "column"
    check_layout_exact(config, ParallelLayout(tp=2))


def _with(**fields):
    config = tiny()
    for key, value in fields.items():
        if key == "truncate":
            config.rope_parameters = {**config.rope_parameters, "truncate": value}
        else:
            setattr(config, key, value)
    return config


@pytest.mark.parametrize("fields, message", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"topk_group": 1}, "num_experts_per_tok / topk_group='4/1'"),
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"truncate": False}, "truncate=False"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"n_group": 3}, "n_group=3"),
    ({"attention_bias": True}, "attention_bias=True"),
])
def test_unsupported_variants_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("/", "/")):
        model_dims(_with(**fields))


def test_mtp_layers_are_named_for_skipping():
    pattern = family_for(tiny()).skipped_hf_tensors(tiny())
    assert pattern.search("model.layers.3.eh_proj.weight") and not pattern.search("model.layers.2.mlp.gate.weight")
    assert family_for(deepseek_v3()).skipped_hf_tensors(deepseek_v3()).search("model.layers.61.enorm.weight")


def test_the_mtp_layer_is_read_whole_for_the_export_fp8_dequantised(tmp_path, caplog):
    """The export copies the MTP layer the bridge skipped from the source checkpoint (``skipped_tensors``): its
    tensors as stored, an FP8 one dequantised (and flagged, so the export writes it in its own dtype), the scale left
    out; a config-only directory gives nothing and says so."""
    import json
    import logging

    import torch
    from safetensors.torch import load_file, save_file

    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.models.loading import skipped_tensors
    from tests.models.fp8_fixture import QUANTIZATION, quantize, reference_dequantize

    source = make_tiny_model("deepseek_v3", "tiny", tmp_path / "fp8", seed=0)
    [file] = source.glob("*.safetensors")
    stored = load_file(file)
    eh_proj = "model.layers.3.eh_proj.weight"
    stored[eh_proj], stored[eh_proj + "_scale_inv"] = quantize(stored[eh_proj])
    save_file(stored, str(file), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    kept = {name: (tensor, dequantised) for name, tensor, dequantised in skipped_tensors(source)}
    assert sorted(kept) == sorted(n for n in stored if n.startswith("model.layers.3.") and not n.endswith("_scale_inv"))
    assert kept[eh_proj][1] and torch.equal(kept[eh_proj][0], reference_dequantize(stored[eh_proj],
                                                                                  stored[eh_proj + "_scale_inv"]))
    norm = "model.layers.3.enorm.weight"
    assert not kept[norm][1] and torch.equal(kept[norm][0], stored[norm])
    file.unlink()
    with caplog.at_level(logging.INFO, logger="megarl.models.loading"):
        assert list(skipped_tensors(source)) == []
    assert "holds no weights: an export leaves out" in caplog.text


def test_shard_mode_plan_sends_each_vllm_rank_its_heads_and_the_replicated_latents():
    """Trainer TP2 x EP2 (2 ranks) -> 2 replicas x vLLM TP2, shard mode: every rank gets exactly its
    vLLM region (q_b/kv_b by heads, q_a/kv_a whole), each byte leaves one source."""
    from megarl.weight_sync.layouts import plan_for_layouts
    from megarl.weight_sync.rollout_layout import RolloutLayout

    plan = plan_for_layouts(tiny(), ParallelLayout(tp=2, ep=2, sequence_parallel=True), 2,
                            RolloutLayout(2, 2, "shard", first_rank=2), itemsize=4)
    plan.check()
    needs = {(p.rank, p.name): p.region for p in plan.needs}
    assert needs[(3, P + "kv_b_proj.weight")] == ((128, 256), (0, 512))  # rank 1 of 2: heads 2-3 of 4
    assert needs[(3, P + "q_a_proj.weight")] == ((0, 96), (0, 128))  # replicated in vLLM's fused_qkv_a_proj
    assert needs[(3, P + "o_proj.weight")] == ((0, 128), (64, 128))
    assert needs[(5, "model.layers.1.mlp.gate.e_score_correction_bias")] == ((0, 16),)
    assert plan.bytes_delivered == plan.bytes_needed()
