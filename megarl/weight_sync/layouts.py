"""Plan a sync from two layouts alone, with no process running: what a 671B job will move.

``trainer_sources`` turns the bridge's shard layout (``megarl.models.param_shards``) into planner
pieces on global trainer ranks (megatron's rank order, data-parallel copies included: the
planner spreads the sending over them). ``plan_for_layouts`` adds the rollout side's needs and
returns the plan. The live trainer builds the same pieces from the ranks' own reports
(``WeightSyncSession``); this module is for planning, capacity arithmetic and tests.
"""
from __future__ import annotations

from collections import defaultdict

from megarl.weight_sync.planner import Piece, SyncPlan, TensorMeta, plan_sync
from megarl.weight_sync.regions import Region
from megarl.weight_sync.rollout_layout import RolloutLayout, rollout_needs


def _region(hf_slice, hf_shape) -> Region:
    return tuple((0 if s.start is None else s.start, n if s.stop is None else s.stop) for s, n in zip(hf_slice, hf_shape))


def trainer_sources(hf_config, layout, world_size: int) -> list[Piece]:
    from megarl.models import param_shards

    return _sources(param_shards(hf_config, layout), layout, world_size)


def _sources(specs, layout, world_size: int) -> list[Piece]:
    from megarl.models import rank_coords

    dense: dict[tuple[int, int], list[int]] = defaultdict(list)
    expert: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for rank in range(world_size):
        c = rank_coords(layout, world_size, rank)
        dense[(c.pp, c.tp)].append(rank)
        expert[(c.pp, c.ep, c.etp)].append(rank)
    pieces = []
    for spec in specs:
        holders = (expert[(spec.pp_stage, spec.ep_rank, spec.etp_rank or 0)] if spec.is_expert
                   else dense[(spec.pp_stage, spec.tp_rank or 0)])
        for piece in spec.pieces:
            region = _region(piece.hf_slice, piece.hf_shape)
            pieces += [Piece(rank, piece.hf_name, region) for rank in holders]
    return pieces


def plan_for_layouts(hf_config, layout, world_size: int, rollout: RolloutLayout, itemsize: int = 2,
                     bucket_bytes: int = 512 << 20) -> SyncPlan:
    """The sync plan from a trainer layout on ``world_size`` ranks to ``rollout`` (bf16 by default;
    buffers such as the router's expert bias stay fp32, as the trainer keeps them)."""
    from megarl.models import hf_tensor_shapes, param_shards, vllm_splits

    shapes = {name: tuple(shape) for name, shape in hf_tensor_shapes(hf_config).items()}
    if rollout.first_rank < world_size:
        raise ValueError(f"rollout ranks must follow the {world_size} trainer ranks (first_rank >= {world_size})")
    needs = rollout_needs(shapes, rollout, vllm_splits(hf_config))
    specs = param_shards(hf_config, layout)
    fp32 = {piece.hf_name for spec in specs if spec.buffer for piece in spec.pieces}
    meta = {name: TensorMeta(shape, 4, "float32") if name in fp32 or itemsize == 4 else TensorMeta(shape, itemsize, "bfloat16")
            for name, shape in shapes.items()}
    return plan_sync(_sources(specs, layout, world_size), needs, meta, bucket_bytes)
