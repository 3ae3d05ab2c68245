"""Context parallelism over packed sequences: which tokens a rank holds, and the gather of keys/values.

Megatron's load-balanced layout (the one Transformer Engine's THD attention expects): every sequence
of a packed micro-batch is padded to a multiple of ``2 x CP`` tokens and cut into ``2 x CP`` equal
chunks; CP rank ``r`` holds chunks ``r`` and ``2 x CP - 1 - r`` of every sequence, one after the
other, sequence after sequence. Under a causal mask an early chunk is cheap and a late one dear, so
every rank gets the same attention work.

On the local layer spec (``megarl.models.attention.core``) a rank all-gathers the keys and values of
its CP group, puts them back in sequence order and attends its own queries to them exactly. The
gather's backward is the matching reduce-scatter: each rank's gradients for the keys it did not
compute go back to the rank that holds them, summed over the ranks that used them (gloo and NCCL
both have them in torch 2.13, which names them ``all_gather_single`` / ``reduce_scatter_single`` and
deprecates the older ``*_into_tensor`` / ``*_tensor`` spellings; older torch has only those).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class PackedLayout:
    """The packed row of one micro-batch (``lengths``: each sequence's padded length) as CP rank
    ``cp_rank`` of ``cp_size`` holds it."""

    lengths: tuple[int, ...]
    cp_size: int = 1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        unit = 2 * self.cp_size if self.cp_size > 1 else 1
        bad = [n for n in self.lengths if n % unit]
        if bad:
            raise ValueError(f"packed sequences of {bad[:4]} tokens do not split into 2 x CP = {unit} chunks; "
                             "pad each sequence to a multiple of 2 x CP")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"CP rank {self.cp_rank} outside a CP group of {self.cp_size}")

    @cached_property
    def offsets(self) -> list[int]:
        """Where each sequence starts in the whole packed row, and its end."""
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        return bounds

    @cached_property
    def local_offsets(self) -> list[int]:
        """Where each sequence starts among this rank's tokens, and its end."""
        return [b // self.cp_size for b in self.offsets]

    def rank_index(self, rank: int) -> torch.Tensor:
        """Indices into the whole packed row of the tokens ``rank`` holds, in its order."""
        if self.cp_size == 1:
            return torch.arange(self.offsets[-1])
        parts, chunks = [], 2 * self.cp_size
        for start, n in zip(self.offsets, self.lengths):
            c = n // chunks
            parts += [torch.arange(start + rank * c, start + (rank + 1) * c),
                      torch.arange(start + (chunks - 1 - rank) * c, start + (chunks - rank) * c)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    @cached_property
    def local_index(self) -> torch.Tensor:
        return self.rank_index(self.cp_rank)

    @cached_property
    def sequence_positions(self) -> torch.Tensor:
        """Each token's position in its own sequence, over the whole packed row (0, 1, ... per sequence)."""
        return torch.cat([torch.arange(n) for n in self.lengths]) if self.lengths else torch.zeros(0, dtype=torch.long)

    @cached_property
    def local_positions(self) -> torch.Tensor:
        return self.sequence_positions[self.local_index]

    @cached_property
    def gather_order(self) -> torch.Tensor:
        """Puts the CP group's all-gathered tokens (rank 0's, rank 1's, ...) in packed-row order."""
        order = torch.empty(self.offsets[-1], dtype=torch.long)
        order[torch.cat([self.rank_index(r) for r in range(self.cp_size)])] = torch.arange(self.offsets[-1])
        return order

    @cached_property
    def segments(self) -> list[tuple[int, int, int, int]]:
        """Per sequence: this rank's queries (local range) and all of the sequence's keys (packed-row range)."""
        return [(self.local_offsets[i], self.local_offsets[i + 1], self.offsets[i], self.offsets[i + 1])
                for i in range(len(self.lengths))]


@lru_cache(maxsize=64)
def packed_layout(lengths: tuple[int, ...], cp_size: int, cp_rank: int) -> PackedLayout:
    """One ``PackedLayout`` per micro-batch shape: every layer of a forward reuses its index tensors."""
    return PackedLayout(lengths, cp_size, cp_rank)


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    bounds = cu_seqlens.tolist()
    return tuple(end - start for start, end in zip(bounds[:-1], bounds[1:]))


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
        _all_gather(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_packed_row(local: torch.Tensor, layout: PackedLayout, group) -> torch.Tensor:
    """This CP group's tokens of ``local`` (``[tokens on this rank, ...]``) as the whole packed row, in
    sequence order; differentiable (the gradient of every token returns to the rank that holds it)."""
    if layout.cp_size == 1:
        return local
    gathered = _GatherTokens.apply(local, group)
    return gathered.index_select(0, layout.gather_order.to(local.device))
