"""A small sync world shared by the weight-sync tests: reference tensors, trainer shards, rollout needs.

Trainer: TP=2 x DP=2 (sync ranks 0..3, rank = dp * 2 + tp); column-parallel weights split rows,
row-parallel weights split columns, norms replicated. Rollout: 2 replicas x TP=2 (ranks 4..7).
Everything is rebuilt from ``seed`` in every process, so no tensor travels except through the
transport under test.
"""
from __future__ import annotations

import torch

from megarl.models import VllmSplit
from megarl.weight_sync.planner import Piece, TensorMeta, plan_sync
from megarl.weight_sync.rollout_layout import RolloutLayout, rollout_needs

TRAINER_TP, TRAINER_DP = 2, 2
SOURCES = list(range(TRAINER_TP * TRAINER_DP))
RECEIVERS = [4, 5, 6, 7]
WORLD = 8

# name: (shape, dtype, trainer split dim or None)
TENSORS = {
    "model.embed_tokens.weight": ((128, 32), torch.float32, 0),
    "model.layers.0.self_attn.q_proj.weight": ((64, 32), torch.bfloat16, 0),
    "model.layers.0.self_attn.o_proj.weight": ((32, 64), torch.float32, 1),
    "model.layers.0.mlp.down_proj.weight": ((32, 96), torch.bfloat16, 1),
    "model.layers.0.input_layernorm.weight": ((33,), torch.bfloat16, None),  # odd bf16 length: misaligned offsets
    "model.norm.weight": ((32,), torch.float32, None),
    "lm_head.weight": ((128, 32), torch.bfloat16, 0),
}


# vLLM's split of each tensor (column-parallel q, row-parallel o/down, vocab-parallel embeddings)
SPLITS = {
    "model.embed_tokens.weight": VllmSplit("vocab"), "lm_head.weight": VllmSplit("vocab"),
    "model.layers.0.self_attn.q_proj.weight": VllmSplit("column"),
    "model.layers.0.self_attn.o_proj.weight": VllmSplit("row"), "model.layers.0.mlp.down_proj.weight": VllmSplit("row"),
    "model.layers.0.input_layernorm.weight": VllmSplit("replicated"), "model.norm.weight": VllmSplit("replicated"),
}


def reference(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, (shape, dtype, _) in TENSORS.items()}


def trainer_region(name: str, tp_rank: int) -> tuple[tuple[int, int], ...]:
    shape, _, dim = TENSORS[name]
    if dim is None:
        return tuple((0, n) for n in shape)
    step = shape[dim] // TRAINER_TP
    return tuple((tp_rank * step, (tp_rank + 1) * step) if d == dim else (0, n) for d, n in enumerate(shape))


def local_shards(rank: int, seed: int) -> dict[str, list]:
    """What trainer rank ``rank`` holds: its TP slice of every tensor, as its own contiguous copy."""
    tp_rank = rank % TRAINER_TP
    full = reference(seed)
    out = {}
    for name in TENSORS:
        region = trainer_region(name, tp_rank)
        out[name] = [(region, full[name][tuple(slice(a, b) for a, b in region)].clone())]
    return out


def meta() -> dict[str, TensorMeta]:
    return {name: TensorMeta(shape, dtype.itemsize, str(dtype).removeprefix("torch."))
            for name, (shape, dtype, _) in TENSORS.items()}


def sources() -> list[Piece]:
    return [Piece(rank, name, trainer_region(name, rank % TRAINER_TP)) for rank in SOURCES for name in TENSORS]


def layout(mode: str) -> RolloutLayout:
    return RolloutLayout(replicas=2, tp=2, mode=mode, first_rank=RECEIVERS[0])


def make_plan(mode: str, bucket_bytes: int):
    shapes = {name: shape for name, (shape, _, _) in TENSORS.items()}
    return plan_sync(sources(), rollout_needs(shapes, layout(mode), SPLITS), meta(), bucket_bytes)


def expected_region(name: str, mode: str, rank: int) -> tuple[slice, ...]:
    """Reference for what a rollout rank must hold, written out from vLLM's rules for these names."""
    shape = TENSORS[name][0]
    full = tuple(slice(0, n) for n in shape)
    tp_rank = (rank - RECEIVERS[0]) % 2
    if mode == "full" or "norm" in name:
        return full
    half = slice(tp_rank * shape[0] // 2, (tp_rank + 1) * shape[0] // 2)
    if "o_proj" in name or "down_proj" in name:
        return (slice(0, shape[0]), slice(tp_rank * shape[1] // 2, (tp_rank + 1) * shape[1] // 2))
    return (half,) + full[1:]  # q_proj rows; embed_tokens / lm_head: vocab 128 padded to 128, halves
