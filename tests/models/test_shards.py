"""The shard layout is exact: pure checks, no processes, tiny families and paper-sized layouts.

The coverage check here is written independently of megarl: slices are boxes; a set of boxes
covers a tensor exactly once iff every box lies inside it, no two boxes overlap, and their
volumes add up to the tensor's element count.
"""
import itertools
import math
from collections import Counter, defaultdict

import pytest

from transformers import LlamaConfig, MixtralConfig

from megarl.models.published import published_config_dir
from megarl.models import (FAMILIES, ParallelLayout, family_for, hf_tensor_shapes, load_hf_config, model_dims, param_shards,
                           rank_shards)
from megarl.devtools.tiny_model import build_config, build_tokenizer
from megarl.devtools.tiny_vision import VISION_LANGUAGE_FAMILIES, vision_token_ids


def _box(slices):
    return tuple((s.start, s.stop) for s in slices)


def _disjoint(a, b):
    return any(a_hi <= b_lo or b_hi <= a_lo for (a_lo, a_hi), (b_lo, b_hi) in zip(a, b))


def assert_exact_cover(shape, boxes, what):
    for box in boxes:
        assert len(box) == len(shape) and all(0 <= lo < hi <= n for (lo, hi), n in zip(box, shape)), (what, box, shape)
    assert sum(math.prod(hi - lo for lo, hi in box) for box in boxes) == math.prod(shape), what
    for a, b in itertools.combinations(boxes, 2):
        assert _disjoint(a, b), (what, a, b)


def check_layout_exact(config, layout, role="actor"):
    """Every HF tensor covered once by primary specs; every local tensor tiled by its pieces (and its
    vocabulary padding, which holds no HF data)."""
    specs = param_shards(config, layout, role)
    shapes = hf_tensor_shapes(config, role)
    primary_boxes = defaultdict(list)
    for spec in specs:
        padding = [_box(spec.padding)] if spec.padding is not None else []
        assert_exact_cover(spec.local_shape, [_box(p.megatron_slice) for p in spec.pieces] + padding, spec.name)
        for piece in spec.pieces:
            assert piece.hf_shape == shapes[piece.hf_name]
            sizes = [hi - lo for lo, hi in _box(piece.hf_slice)]
            assert sizes == [hi - lo for lo, hi in _box(piece.megatron_slice)], spec.name
            if spec.primary:
                primary_boxes[piece.hf_name].append(_box(piece.hf_slice))
    assert sorted(primary_boxes) == sorted(shapes)
    for name, shape in shapes.items():
        assert_exact_cover(shape, primary_boxes[name], name)
    # A rank never holds two params under the same name.
    owners = Counter((s.pp_stage, s.vpp_chunk, s.tp_rank, s.ep_rank, s.etp_rank, s.name) for s in specs)
    assert max(owners.values()) == 1
    return specs


TINY_LAYOUTS = [
    ParallelLayout(),
    ParallelLayout(tp=2),
    ParallelLayout(tp=4, sequence_parallel=True),
    ParallelLayout(pp=2),
    ParallelLayout(tp=2, pp=2),
]
MOE_LAYOUTS = [ParallelLayout(ep=2), ParallelLayout(ep=4), ParallelLayout(tp=2, ep=2, etp=2), ParallelLayout(tp=2, pp=2, ep=4)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_families_are_covered_exactly(family, tied):
    ids = vision_token_ids(build_tokenizer(family)) if family in VISION_LANGUAGE_FAMILIES else None
    config = build_config(family, "small", tie_word_embeddings=tied, special_token_ids=ids)
    layouts = TINY_LAYOUTS + [ParallelLayout(pp=2, vpp=2), ParallelLayout(tp=2, pp=2, vpp=2)]
    if family in ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "kimi_k2", "gpt_oss", "qwen3_next", "qwen3_5_moe",
                  "qwen3_vl_moe"):
        layouts += MOE_LAYOUTS
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # 2 DeltaNet key heads: TP=4 is refused (test_qwen3_next.py)
        layouts = [layout for layout in layouts if layout.tp <= 2]
    for layout in layouts:
        check_layout_exact(config, layout)


def test_replicated_params_have_one_primary_copy_per_tp_group():
    config = build_config("qwen3", "small")  # 4 KV groups
    specs = [s for s in param_shards(config, ParallelLayout(tp=4)) if s.name == "decoder.layers.1.self_attention.q_layernorm.weight"]
    assert sorted(s.tp_rank for s in specs) == [0, 1, 2, 3]
    assert [s.tp_rank for s in specs if s.primary] == [0]
    assert all(s.split_dim is None and s.local_shape == (32,) for s in specs)


def test_fused_qkv_by_hand():
    # tiny: 4 heads, 2 KV groups, head_dim 32 -> per group [q: 64 rows, k: 32, v: 32]; TP=2 rank 1 holds group 1.
    config = build_config("qwen2", "tiny")
    [spec] = [s for s in rank_shards(config, ParallelLayout(tp=2), pp_stage=0, tp_rank=1) if s.name == "decoder.layers.0.self_attention.linear_qkv.weight"]
    assert spec.local_shape == (128, 128) and spec.split_dim == 0
    pieces = [(p.hf_name.rsplit(".", 2)[-2], _box(p.hf_slice)[0], _box(p.megatron_slice)[0]) for p in spec.pieces]
    assert pieces == [("q_proj", (64, 128), (0, 64)), ("k_proj", (32, 64), (64, 96)), ("v_proj", (32, 64), (96, 128))]
    # TP=1: both groups, interleaved [q0 k0 v0 q1 k1 v1].
    [bias] = [s for s in rank_shards(config, ParallelLayout(), 0, 0) if s.name == "decoder.layers.0.self_attention.linear_qkv.bias"]
    assert [(_box(p.hf_slice)[0], _box(p.megatron_slice)[0]) for p in bias.pieces] == [
        ((0, 64), (0, 64)), ((0, 32), (64, 96)), ((0, 32), (96, 128)),
        ((64, 128), (128, 192)), ((32, 64), (192, 224)), ((32, 64), (224, 256)),
    ]


def test_fused_gate_up_and_row_parallel_by_hand():
    config = build_config("llama", "tiny")  # intermediate 256, hidden 128
    specs = {s.name: s for s in rank_shards(config, ParallelLayout(tp=2), pp_stage=0, tp_rank=1)}
    fc1 = specs["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.local_shape == (256, 128)
    assert [(p.hf_name.split(".")[-2], _box(p.hf_slice)[0], _box(p.megatron_slice)[0]) for p in fc1.pieces] == [
        ("gate_proj", (128, 256), (0, 128)), ("up_proj", (128, 256), (128, 256)),
    ]
    fc2 = specs["decoder.layers.0.mlp.linear_fc2.weight"]
    assert fc2.split_dim == 1 and fc2.local_shape == (128, 128)
    assert _box(fc2.pieces[0].hf_slice) == ((0, 128), (128, 256))
    embedding = specs["embedding.word_embeddings.weight"]
    assert _box(embedding.pieces[0].hf_slice) == ((256, 512), (0, 128))


def test_experts_live_on_their_ep_rank_with_local_names():
    config = build_config("mixtral", "tiny")  # 4 experts
    specs = rank_shards(config, ParallelLayout(ep=2), pp_stage=0, tp_rank=0, ep_rank=1)
    experts = [s for s in specs if s.is_expert and s.name.startswith("decoder.layers.0.")]
    assert {(s.name, s.global_name.split(".")[6]) for s in experts} == {
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", "2"),
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", "2"),
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", "3"),
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", "3"),
    }
    fc1 = [s for s in experts if s.name.endswith("local_experts.1.linear_fc1.weight")][0]
    assert [p.hf_name for p in fc1.pieces] == [
        "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "model.layers.0.block_sparse_moe.experts.3.w3.weight",
    ]
    assert all(s.ep_rank == 1 and s.tp_rank is None for s in experts)
    # Dense params are held by every EP rank (ep_rank None) and split over TP as usual.
    assert all(s.ep_rank is None for s in specs if not s.is_expert)


def test_tied_embeddings():
    config = build_config("llama", "tiny", tie_word_embeddings=True)
    assert "lm_head.weight" not in hf_tensor_shapes(config)
    assert not [s for s in param_shards(config, ParallelLayout()) if s.name == "output_layer.weight"]
    outputs = [s for s in param_shards(config, ParallelLayout(pp=2, tp=2)) if s.name == "output_layer.weight"]
    assert len(outputs) == 2 and all(s.pp_stage == 1 and not s.primary for s in outputs)
    assert {p.hf_name for s in outputs for p in s.pieces} == {"model.embed_tokens.weight"}


def test_critic_has_a_replicated_value_head_and_no_lm_head():
    config = build_config("qwen2", "tiny")
    check_layout_exact(config, ParallelLayout(tp=2, pp=2), role="critic")
    shapes = hf_tensor_shapes(config, role="critic")
    assert shapes["score.weight"] == (1, 128) and shapes["score.bias"] == (1,) and "lm_head.weight" not in shapes


def test_transformer_engine_names_fuse_the_norms_into_the_linears():
    config = build_config("qwen3_moe", "tiny")
    config.mlp_only_layers = [0]  # layer 0 dense, layer 1 MoE
    names = {s.name for s in param_shards(config, ParallelLayout(), transformer_impl="transformer_engine")}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names  # dense MLP: fused
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names  # MoE: a separate norm
    assert not any(name.endswith("input_layernorm.weight") for name in names)


def test_qwen3_moe_dense_layers():
    config = build_config("qwen3_moe", "tiny")
    config.mlp_only_layers = [0]
    dims = model_dims(config)
    assert dims.moe.layers == (False, True)
    names = {s.name for s in param_shards(config, ParallelLayout(ep=2))}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names and "decoder.layers.1.mlp.router.weight" in names
    check_layout_exact(config, ParallelLayout(tp=2, ep=2))


# ---------------------------------------------------------------- paper-sized layouts


def llama3_70b():
    return LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        architectures=["LlamaForCausalLM"],
    )


def deepseek_v3():
    """The real DeepSeek-V3 (671B) config.json, as published with the checkpoint."""
    return load_hf_config(published_config_dir("deepseek-v3"))


def test_llama3_70b_tp8_pp4():
    layout = ParallelLayout(tp=8, pp=4)
    specs = check_layout_exact(llama3_70b(), layout)
    stage_layers = defaultdict(set)
    for spec in specs:
        if spec.global_name.startswith("decoder.layers."):
            stage_layers[spec.pp_stage].add(int(spec.global_name.split(".")[2]))
    assert {stage: (min(l), max(l), len(l)) for stage, l in stage_layers.items()} == {
        0: (0, 19, 20), 1: (20, 39, 20), 2: (40, 59, 20), 3: (60, 79, 20)
    }
    local = {s.name: s.local_shape for s in specs if s.pp_stage == 1 and s.tp_rank == 3}
    assert local["decoder.layers.0.self_attention.linear_qkv.weight"] == ((8 + 2) * 128, 8192)  # 8 q heads + k + v
    assert local["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 28672 // 8, 8192)
    assert local["decoder.layers.0.mlp.linear_fc2.weight"] == (8192, 28672 // 8)
    params = sum(math.prod(shape) for shape in hf_tensor_shapes(llama3_70b()).values())
    assert 70.0e9 < params < 71.0e9


def test_llama3_70b_with_virtual_pipeline():
    specs = check_layout_exact(llama3_70b(), ParallelLayout(tp=8, pp=4, vpp=5))
    chunk_first_layers = sorted({(s.vpp_chunk, s.pp_stage, int(s.global_name.split(".")[2]))
                                 for s in specs if s.name.startswith("decoder.layers.0.")})
    assert chunk_first_layers[:5] == [(0, 0, 0), (0, 1, 4), (0, 2, 8), (0, 3, 12), (1, 0, 16)]


def test_deepseek_v3_pp16_ep16_with_verl_uneven_stages():
    """verl's 671B layout: PP16 x EP16, 61 layers as 4 + 14 x 4 + 1."""
    layout = ParallelLayout(pp=16, ep=16, first_stage_layers=4, last_stage_layers=1)
    specs = check_layout_exact(deepseek_v3(), layout)
    experts_by_rank = defaultdict(set)
    layers_by_stage = defaultdict(set)
    for spec in specs:
        if spec.global_name.startswith("decoder.layers."):
            layers_by_stage[spec.pp_stage].add(int(spec.global_name.split(".")[2]))
        if spec.is_expert:
            experts_by_rank[(spec.pp_stage, spec.ep_rank)].add(int(spec.global_name.split(".")[6]))
    for (stage, ep_rank), experts in experts_by_rank.items():
        assert experts == set(range(16 * ep_rank, 16 * ep_rank + 16)), (stage, ep_rank)
    assert [len(layers_by_stage[s]) for s in range(16)] == [4] + [4] * 14 + [1]
    assert layers_by_stage[0] == {0, 1, 2, 3} and layers_by_stage[15] == {60}
    assert {stage for stage, _ in experts_by_rank} == set(range(16))  # stage 0 holds MoE layer 3
    params = sum(math.prod(shape) for shape in hf_tensor_shapes(deepseek_v3()).values())
    assert 671.0e9 < params < 671.1e9  # the main model; the MTP layer is not part of it
    names = {s.name for s in specs if s.pp_stage == 1 and s.ep_rank in (None, 0)}
    assert "decoder.layers.0.mlp.router.expert_bias" in names  # the fp32 buffer travels with the router
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1.weight" in names


@pytest.mark.parametrize(
    "config,layout,message",
    [
        (build_config("llama", "tiny"), ParallelLayout(tp=4 * 2), "num_key_value_heads"),
        (build_config("llama", "tiny"), ParallelLayout(tp=8), "num_attention_heads=4 is not divisible by tp=8"),
        (build_config("mixtral", "tiny"), ParallelLayout(ep=3), "num_experts=4"),
        (build_config("llama", "tiny"), ParallelLayout(ep=2), "need a MoE model"),
        (build_config("llama", "tiny"), ParallelLayout(pp=4), "cannot be split evenly"),
    ],
)
def test_impossible_layouts_are_rejected(config, layout, message):
    with pytest.raises(ValueError, match=message):
        param_shards(config, layout)


def test_family_registry():
    assert family_for(MixtralConfig()).name == "mixtral"  # no architectures: by model_type
    critic = LlamaConfig(architectures=["LlamaForTokenClassification"])
    assert family_for(critic).name == "llama"
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="no megatron bridge"):
        family_for(GPT2Config())


def test_config_reading_across_transformers_conventions():
    mixtral = MixtralConfig(hidden_size=256, num_attention_heads=8, head_dim=None)
    assert model_dims(mixtral).attention.head_dim == 32
    old_style = LlamaConfig(hidden_size=64, num_attention_heads=4)
    old_style.rope_parameters = None
    old_style.rope_theta, old_style.rope_scaling = 123.0, None
    assert model_dims(old_style).rope.theta == 123.0
    assert model_dims(llama3_70b()).rope.factor == 8.0
    yarn = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        model_dims(yarn)
    windowed = MixtralConfig(sliding_window=4096)
    with pytest.raises(ValueError, match="sliding-window attention"):
        model_dims(windowed)


def test_vocabulary_is_padded_for_tensor_parallelism():
    """megatron's rule: a multiple of make_vocab_size_divisible_by * tp; padding rows hold no HF data."""
    config = build_config("llama", "small", vocab_size=504)
    for layout, padded in [(ParallelLayout(), 512), (ParallelLayout(tp=2), 512), (ParallelLayout(tp=4), 512),
                           (ParallelLayout(tp=2, make_vocab_size_divisible_by=1), 504),
                           (ParallelLayout(tp=2, make_vocab_size_divisible_by=100), 600)]:
        assert layout.padded_vocab_size(504) == padded
        specs = check_layout_exact(config, layout)
        embedding = [s for s in specs if s.name == "embedding.word_embeddings.weight"]
        assert [s.local_shape[0] for s in embedding] == [padded // layout.tp] * layout.tp
        held = sum(p.hf_slice[0].stop - p.hf_slice[0].start for s in embedding for p in s.pieces)
        assert held == 504  # only real rows are loaded, exported and synced
    # TP=4 of 512 rows: 128 per rank; the last rank holds 120 real rows and 8 padding rows.
    last = [s for s in param_shards(config, ParallelLayout(tp=4)) if s.name == "output_layer.weight"][-1]
    assert _box(last.pieces[0].hf_slice)[0] == (384, 504) and _box(last.padding)[0] == (120, 128)
    # A rank may hold only padding.
    tiny_vocab = build_config("llama", "tiny", vocab_size=264)
    layout = ParallelLayout(tp=2, make_vocab_size_divisible_by=200)  # 264 -> 400: rank 1 holds rows 200..263
    assert [len(s.pieces) for s in param_shards(tiny_vocab, layout) if s.name == "output_layer.weight"] == [1, 1]
    layout = ParallelLayout(tp=2, make_vocab_size_divisible_by=300)  # 264 -> 600: rank 1 holds only padding
    out = [s for s in param_shards(tiny_vocab, layout) if s.name == "output_layer.weight"]
    assert [len(s.pieces) for s in out] == [1, 0] and _box(out[1].padding)[0] == (0, 300)
    check_layout_exact(tiny_vocab, layout)
