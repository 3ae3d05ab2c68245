"""The planner: every needed byte delivered exactly once, every byte sent by one source, buckets bounded."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from megarl.weight_sync.planner import Piece, PlanError, TensorMeta, plan_sync
from megarl.weight_sync.regions import merge_adjacent, region_numel
from megarl.models import VllmSplit, vllm_splits
from megarl.devtools.tiny_model import FAMILIES, build_config
from megarl.weight_sync.rollout_layout import RolloutLayout, rollout_needs


def tp_sources(name, shape, tp, dim, ranks):
    """Reference: a tensor split evenly along ``dim`` over ``tp`` ranks (rank list per shard)."""
    step = shape[dim] // tp
    out = []
    for t in range(tp):
        region = tuple((t * step, (t + 1) * step) if d == dim else (0, n) for d, n in enumerate(shape))
        for rank in ranks[t]:
            out.append(Piece(rank, name, region))
    return out


def delivered_counts(plan, shapes):
    """Count, with numpy, how often each element reaches each destination rank."""
    counts = {}
    for bucket in plan.buckets:
        for t in bucket.transfers:
            for dst in t.dsts:
                arr = counts.setdefault((dst, t.name), np.zeros(shapes[t.name], dtype=np.int64))
                arr[tuple(slice(a, b) for a, b in t.region)] += 1
    return counts


def test_hand_example_two_replicas_full_tensors():
    meta = {"w": TensorMeta((8, 4), 4)}
    # TP=2 along dim 0, two data-parallel copies: ranks 0,1 and 2,3
    sources = tp_sources("w", (8, 4), 2, 0, [[0, 2], [1, 3]])
    needs = [Piece(10, "w", ((0, 8), (0, 4))), Piece(11, "w", ((0, 8), (0, 4)))]
    plan = plan_sync(sources, needs, meta, bucket_bytes=1 << 20)
    plan.check()
    assert plan.bytes_sent == 8 * 4 * 4  # each byte leaves once
    assert plan.bytes_delivered == 2 * 8 * 4 * 4
    routes = sorted((b.src, b.dsts, b.transfers[0].region) for b in plan.buckets)
    assert routes == [(0, (10, 11), ((0, 4), (0, 4))), (1, (10, 11), ((4, 8), (0, 4)))]


def test_resharding_row_split_to_column_split():
    # trainer splits dim 1 over 4 ranks, rollout splits dim 0 over 2 ranks: 2D cells
    shapes = {"w": (6, 8)}
    meta = {"w": TensorMeta((6, 8), 2)}
    sources = tp_sources("w", (6, 8), 4, 1, [[0], [1], [2], [3]])
    needs = [Piece(4, "w", ((0, 3), (0, 8))), Piece(5, "w", ((3, 6), (0, 8)))]
    plan = plan_sync(sources, needs, meta, bucket_bytes=1 << 20)
    plan.check()
    counts = delivered_counts(plan, shapes)
    assert (counts[(4, "w")][0:3] == 1).all() and (counts[(4, "w")][3:] == 0).all()
    assert (counts[(5, "w")][3:] == 1).all() and (counts[(5, "w")][:3] == 0).all()
    assert plan.bytes_sent == 6 * 8 * 2


def test_replicated_tensors_are_spread_over_holders():
    meta = {f"norm{i}": TensorMeta((16,), 4) for i in range(8)}
    sources = [Piece(r, n, ((0, 16),)) for n in meta for r in range(4)]  # every rank holds every norm
    needs = [Piece(9, n, ((0, 16),)) for n in meta]
    plan = plan_sync(sources, needs, meta, bucket_bytes=1 << 20)
    plan.check()
    assert plan.bytes_by_source() == {0: 128, 1: 128, 2: 128, 3: 128}


def test_buckets_are_bounded_and_large_tensors_split_into_rows():
    meta = {"emb": TensorMeta((100, 10), 4), "b": TensorMeta((10,), 4)}
    sources = [Piece(0, "emb", ((0, 100), (0, 10))), Piece(0, "b", ((0, 10),))]
    needs = [Piece(1, "emb", ((0, 100), (0, 10))), Piece(1, "b", ((0, 10),))]
    plan = plan_sync(sources, needs, meta, bucket_bytes=1000)
    plan.check()
    assert all(b.nbytes <= 1000 for b in plan.buckets)
    assert plan.bytes_sent == 100 * 10 * 4 + 40
    assert len(plan.buckets) == 5  # 4000 B of rows in 25-row chunks + the bias packed behind them


def test_missing_source_is_a_clear_error():
    meta = {"w": TensorMeta((4,), 4)}
    with pytest.raises(PlanError, match=r"no trainer rank holds w\[\(2, 4\)\]"):
        plan_sync([Piece(0, "w", ((0, 2),))], [Piece(1, "w", ((0, 4),))], meta, 64)
    with pytest.raises(PlanError, match="no trainer rank holds 'v'"):
        plan_sync([], [Piece(1, "v", ((0, 4),))], {"v": TensorMeta((4,), 4)}, 64)


def test_random_layouts_deliver_every_element_exactly_once():
    rng = random.Random(0)
    for trial in range(40):
        shape = (rng.choice([4, 8, 12, 24]), rng.choice([4, 8, 16]))
        meta = {"w": TensorMeta(shape, 2)}
        src_tp = rng.choice([d for d in (1, 2, 4) if shape[0] % d == 0 and shape[1] % d == 0])
        src_dim = rng.randrange(2)
        dp = rng.choice([1, 2, 3])
        ranks = [[t + src_tp * k for k in range(dp)] for t in range(src_tp)]
        sources = tp_sources("w", shape, src_tp, src_dim, ranks)
        first = src_tp * dp
        dst_tp = rng.choice([d for d in (1, 2, 4) if shape[0] % d == 0 and shape[1] % d == 0])
        dst_dim = rng.randrange(2)
        replicas = rng.choice([1, 2, 3])
        needs = []
        for rep in range(replicas):
            step = shape[dst_dim] // dst_tp
            for t in range(dst_tp):
                region = tuple((t * step, (t + 1) * step) if d == dst_dim else (0, n) for d, n in enumerate(shape))
                needs.append(Piece(first + rep * dst_tp + t, "w", region))
        plan = plan_sync(sources, needs, meta, bucket_bytes=rng.choice([8, 64, 1 << 20]))
        plan.check()
        counts = delivered_counts(plan, {"w": shape})
        for p in needs:
            arr = counts[(p.rank, "w")]
            inside = arr[tuple(slice(a, b) for a, b in p.region)]
            assert (inside == 1).all() and arr.sum() == inside.sum()
        # each element of the tensor leaves exactly one source (replicas fan out by broadcast)
        sent = np.zeros(shape, dtype=np.int64)
        for bucket in plan.buckets:
            for t in bucket.transfers:
                sent[tuple(slice(a, b) for a, b in t.region)] += 1
        assert (sent == 1).all(), trial


def test_merge_adjacent_cells():
    cells = [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 2)), ((4, 6), (2, 4))]
    assert merge_adjacent(cells) == [((0, 6), (0, 4))]
    assert sum(region_numel(c) for c in cells) == 24


# ---------------------------------------------------------------- vLLM's sharding rules
def reference_vllm_slice(name, shape, tp, rank, kv_heads):
    """Straightforward restatement of vLLM's rules, per layer type."""
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (shape[0], None)
    rest = [(0, cols)] if cols is not None else []
    if "embed_tokens" in name or "lm_head" in name:
        padded = (rows + 63) // 64 * 64
        per = padded // tp
        start, stop = min(rank * per, rows), min(rank * per + per, rows)
        return tuple([(start, stop)] + rest) if start < stop else ()
    if "k_proj" in name or "v_proj" in name:
        head_dim = rows // kv_heads
        if kv_heads >= tp:
            per = rows // tp
            return tuple([(rank * per, rank * per + per)] + rest)
        head = rank * kv_heads // tp
        return tuple([(head * head_dim, head * head_dim + head_dim)] + rest)
    if any(k in name for k in ("q_proj", "gate_proj", "up_proj", ".w1.", ".w3.")):
        per = rows // tp
        return tuple([(rank * per, rank * per + per)] + rest)
    if any(k in name for k in ("o_proj", "down_proj", ".w2.")):
        per = cols // tp
        return ((0, rows), (rank * per, rank * per + per))
    return tuple([(0, rows)] + rest)


# MLA: test_deepseek_v3.py; gpt-oss: its expert rows against vLLM's loader (tests/models/test_vllm_expert_rows.py), its
# attention in tests/models/test_gpt_oss.py; Qwen3-Next, Qwen3.5: their
# DeltaNet splits are checked against vLLM's own loaders (tests/models/test_vllm_delta_net_splits.py)
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"deepseek_v3", "kimi_k2", "gpt_oss", "qwen3_next", "qwen3_5",
                                                           "qwen3_5_moe", "qwen2_5_vl", "qwen3_vl"}))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shard_regions_follow_vllm_rules(family, tp):
    """Every tensor of every GQA family: the split derived from the bridge's maps = vLLM's rules by layer name
    (Qwen3-VL-MoE: its language model's, each expert's parts included; its tower goes whole, tested below)."""
    from megarl.devtools.tiny_model import build_tokenizer
    from megarl.devtools.tiny_vision import VISION_LANGUAGE_FAMILIES, vision_token_ids

    ids = vision_token_ids(build_tokenizer(family)) if family in VISION_LANGUAGE_FAMILIES else None
    config = build_config(family, "small", special_token_ids=ids)  # 8 heads, 4 KV heads: at TP=8 each KV head on 2 ranks
    splits = vllm_splits(config)
    from megarl.models import hf_tensor_shapes

    for name, shape in hf_tensor_shapes(config).items():
        if ".visual." in name:
            continue
        for rank in range(tp):
            assert splits[name].region(name, shape, tp, rank) == reference_vllm_slice(
                name, shape, tp, rank, getattr(config, "text_config", config).num_key_value_heads), (name, tp, rank)


SHAPES = {
    "model.embed_tokens.weight": (1000, 64), "lm_head.weight": (1000, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.layers.0.block_sparse_moe.experts.3.w1.weight": (128, 64),
    "model.layers.0.block_sparse_moe.experts.3.w2.weight": (64, 128),
}
SPLITS = {name: VllmSplit("vocab" if "embed" in name or "lm_head" in name else
                          "row" if "o_proj" in name or "down_proj" in name or ".w2." in name else "column")
          for name in SHAPES}


def test_shard_mode_moves_a_tp_fraction_and_full_mode_everything():
    shapes = {k: v for k, v in SHAPES.items() if "embed" not in k and "lm_head" not in k}
    meta = {n: TensorMeta(s, 2) for n, s in shapes.items()}
    sources = [Piece(0, n, tuple((0, d) for d in s)) for n, s in shapes.items()]
    total = sum(region_numel(tuple((0, d) for d in s)) * 2 for s in shapes.values())
    for mode, expected_delivered in (("full", 2 * 4 * total), ("shard", 2 * total)):
        layout = RolloutLayout(replicas=2, tp=4, mode=mode, first_rank=1)
        plan = plan_sync(sources, rollout_needs(shapes, layout, SPLITS), meta, 1 << 20)
        plan.check()
        assert plan.bytes_sent == total
        assert plan.bytes_delivered == expected_delivered


def test_rollout_ranks_are_numbered_replica_major():
    layout = RolloutLayout(replicas=2, tp=2, first_rank=4)
    assert layout.ranks == [4, 5, 6, 7] and layout.rank(1, 0) == 6
    with pytest.raises(ValueError, match="mode"):
        RolloutLayout(1, 1, mode="half")
    assert list(itertools.islice(layout.ranks, 1)) == [4]


def test_context_parallel_ranks_are_replicas_and_each_byte_is_sent_once():
    """TP2 x CP2 x DP2 on 8 trainer ranks: CP ranks hold the same shards as their TP peers (holders
    of every piece include both CP ranks) and the plan sends every byte of the model once, as at CP1."""
    from megarl.models import ParallelLayout, hf_tensor_shapes, rank_coords
    from megarl.weight_sync.layouts import plan_for_layouts, trainer_sources

    config = build_config("llama", "tiny")
    total = sum(int(np.prod(s)) * 2 for s in hf_tensor_shapes(config).values())
    rollout = RolloutLayout(replicas=1, tp=2, first_rank=8)
    layout = ParallelLayout(tp=2, cp=2)
    holders = {}
    for piece in trainer_sources(config, layout, 8):
        holders.setdefault((piece.name, piece.region), set()).add(rank_coords(layout, 8, piece.rank).cp)
    assert holders and all(cps == {0, 1} for cps in holders.values())
    for cp in (1, 2):
        plan = plan_for_layouts(config, ParallelLayout(tp=2, cp=cp), 8, rollout)
        plan.check()
        assert plan.bytes_sent == total


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_shard_mode_sends_a_vision_tower_whole_to_every_engine_rank_once(family, tmp_path):
    """GPU engines (shard mode), trainer TP2 -> one replica at TP2: the language model goes TP shard to TP shard;
    the tower (replicated in megarl, split by vLLM's own loaders) reaches both engine ranks whole, sent once (a
    broadcast), from either trainer rank; every byte of the model leaves the trainer once."""
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.models import ParallelLayout, hf_tensor_shapes, load_hf_config, model_dims
    from megarl.weight_sync.layouts import plan_for_layouts

    config = load_hf_config(make_tiny_model(family, "tiny", tmp_path / family))
    shapes = hf_tensor_shapes(config)
    tower = model_dims(config).vision.hf_prefix
    plan = plan_for_layouts(config, ParallelLayout(tp=2), 2, RolloutLayout(replicas=1, tp=2, mode="shard", first_rank=2))
    plan.check()
    assert plan.bytes_sent == sum(int(np.prod(s)) * 2 for s in shapes.values())
    needs = {(p.rank, p.name): p.region for p in plan.needs}
    towers = [name for name in shapes if name.startswith(tower)]
    assert len(towers) > 10
    for name in towers:
        for rank in (2, 3):
            assert needs[(rank, name)] == tuple((0, n) for n in shapes[name]), name
    q = model_dims(config).hf_prefix + "layers.0.self_attn.q_proj.weight"
    assert needs[(2, q)][0] == (0, shapes[q][0] // 2) and needs[(3, q)][0] == (shapes[q][0] // 2, shapes[q][0])
    routes = {(t.name, t.region): bucket.dsts for bucket in plan.buckets for t in bucket.transfers}
    assert all(routes[(name, tuple((0, n) for n in shapes[name]))] == (2, 3) for name in towers)


def test_a_frozen_vision_tower_is_left_out_of_the_sync_and_a_text_model_has_none(tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.settings.sync import frozen_tensors
    from megarl.weight_sync.errors import SyncError
    from megarl.weight_sync.session import WeightSyncSession

    vl, text = make_tiny_model("qwen3_vl", "tiny", tmp_path / "vl"), make_tiny_model("qwen3", "tiny", tmp_path / "text")
    assert frozen_tensors(str(vl), True) == ("model.visual.",) and frozen_tensors(str(vl), False) == ()
    with pytest.raises(ValueError, match="not a vision-language model"):
        frozen_tensors(str(text), True)
    with pytest.raises(SyncError, match=r"no tensor of .* starts with \['model.visual.'\]"):
        WeightSyncSession(None, None, str(text), leave_out=("model.visual.",))  # refused before any process is asked
