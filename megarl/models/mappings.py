"""How one megatron-core parameter is made of Hugging Face tensors, and how TP splits it.

Each mapping kind answers one question: on TP rank ``r`` of ``parts``, which rows (or columns)
of which HF tensors does the local megatron tensor hold, in what order? The answer is a list of
``Block``s laid end to end along the split dimension. ``megarl.models.shards`` turns blocks into
exact (hf_slice, megatron_slice) pieces.

Kinds:
  Replicated   the whole HF tensor on every TP rank (norms, router, value head).
  Split        one HF tensor cut into ``parts`` equal ranges along ``dim``:
               dim 0 = column-parallel linear or vocab-parallel embedding/output,
               dim 1 = row-parallel linear.
  FusedQKV     megatron's ``linear_qkv``: per query group g, [q rows of g's heads; k_g; v_g];
               TP ranks hold whole groups.
  GatedQKV     FusedQKV with an output gate (Qwen3-Next): HF's ``q_proj`` holds [q_h; gate_h] per head,
               megatron's ``linear_qkv`` per query group [q of its heads; their gates; k_g; v_g].
  FusedGateUp  megatron's ``linear_fc1`` with SwiGLU: each TP rank holds [its gate rows; its up rows].
  HeadGroups   one HF tensor of consecutive parts, each in head-group order (the gated DeltaNet's ``conv1d``:
               [q of every key head; k of every key head; v of every value head]), held group by group:
               per group g [part 0 rows of g; part 1 rows of g; ...]; TP ranks hold whole groups.
  VocabSplit   the embedding / output layer: the vocabulary padded to ``padded`` rows (megatron's
               ``make_vocab_size_divisible_by`` rule), split evenly; the padding rows, at the end
               of the last rank(s), come from no HF tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class HFTensor:
    """A tensor of the HF checkpoint: its name and global shape."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) of ``tensor`` along the split dimension (all of the other dims)."""

    tensor: HFTensor
    start: int
    stop: int


def _part(size: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"{what}: size {size} is not divisible by {parts} tensor-parallel ranks; pick a TP size dividing it")
    step = size // parts
    return rank * step, (rank + 1) * step


@dataclass(frozen=True)
class Replicated:
    tensor: HFTensor
    split_dim = None

    def tensors(self) -> tuple[HFTensor, ...]:
        return (self.tensor,)

    def blocks(self, parts: int, rank: int) -> list[Block]:
        return [Block(self.tensor, 0, self.tensor.shape[0])]


@dataclass(frozen=True)
class Split:
    tensor: HFTensor
    dim: int

    @property
    def split_dim(self) -> int:
        return self.dim

    def tensors(self) -> tuple[HFTensor, ...]:
        return (self.tensor,)

    def blocks(self, parts: int, rank: int) -> list[Block]:
        start, stop = _part(self.tensor.shape[self.dim], parts, rank, self.tensor.name)
        return [Block(self.tensor, start, stop)]


@dataclass(frozen=True)
class FusedQKV:
    """q [heads*head_dim, ...], k and v [groups*head_dim, ...] fused per query group along dim 0."""

    q: HFTensor
    k: HFTensor
    v: HFTensor
    num_groups: int
    heads_per_group: int
    head_dim: int
    split_dim = 0

    def tensors(self) -> tuple[HFTensor, ...]:
        return (self.q, self.k, self.v)

    def blocks(self, parts: int, rank: int) -> list[Block]:
        first, last = _part(self.num_groups, parts, rank, f"query groups of {self.q.name}")
        q_rows, kv_rows = self.heads_per_group * self.head_dim, self.head_dim
        blocks = []
        for g in range(first, last):
            blocks.append(Block(self.q, g * q_rows, (g + 1) * q_rows))
            blocks.append(Block(self.k, g * kv_rows, (g + 1) * kv_rows))
            blocks.append(Block(self.v, g * kv_rows, (g + 1) * kv_rows))
        return blocks


@dataclass(frozen=True)
class GatedQKV:
    """q_proj [heads * 2 * head_dim, ...] ([q_h; gate_h] per head h), k and v [groups * head_dim, ...], fused
    per query group as megatron's ``attention_output_gate`` reads them: [q of the group's heads; their
    gates; k_g; v_g]. TP ranks hold whole groups."""

    q: HFTensor
    k: HFTensor
    v: HFTensor
    num_groups: int
    heads_per_group: int
    head_dim: int
    split_dim = 0

    def tensors(self) -> tuple[HFTensor, ...]:
        return (self.q, self.k, self.v)

    def blocks(self, parts: int, rank: int) -> list[Block]:
        first, last = _part(self.num_groups, parts, rank, f"query groups of {self.q.name}")
        d, blocks = self.head_dim, []
        for g in range(first, last):
            heads = range(g * self.heads_per_group, (g + 1) * self.heads_per_group)
            blocks += [Block(self.q, 2 * h * d, (2 * h + 1) * d) for h in heads]
            blocks += [Block(self.q, (2 * h + 1) * d, (2 * h + 2) * d) for h in heads]
            blocks += [Block(self.k, g * d, (g + 1) * d), Block(self.v, g * d, (g + 1) * d)]
        return blocks


@dataclass(frozen=True)
class FusedGateUp:
    """gate and up [ffn, hidden] fused along dim 0; each rank holds its gate part then its up part."""

    gate: HFTensor
    up: HFTensor
    split_dim = 0

    def tensors(self) -> tuple[HFTensor, ...]:
        return (self.gate, self.up)

    def blocks(self, parts: int, rank: int) -> list[Block]:
        start, stop = _part(self.gate.shape[0], parts, rank, self.gate.name)
        return [Block(self.gate, start, stop), Block(self.up, start, stop)]


@dataclass(frozen=True)
class HeadGroups:
    """``tensor`` [sum of ``part_rows`` * groups, ...]: parts laid end to end along dim 0, part p holding
    ``part_rows[p]`` rows per group; megatron's tensor holds them group by group."""

    tensor: HFTensor
    part_rows: tuple[int, ...]
    num_groups: int
    split_dim = 0

    def tensors(self) -> tuple[HFTensor, ...]:
        return (self.tensor,)

    def blocks(self, parts: int, rank: int) -> list[Block]:
        if sum(self.part_rows) * self.num_groups != self.tensor.shape[0]:
            raise ValueError(f"{self.tensor.name}: {self.tensor.shape[0]} rows are not {self.num_groups} groups of "
                             f"{'+'.join(map(str, self.part_rows))}")
        first, last = _part(self.num_groups, parts, rank, f"head groups of {self.tensor.name}")
        starts = [self.num_groups * sum(self.part_rows[:p]) for p in range(len(self.part_rows))]
        return [Block(self.tensor, start + g * rows, start + (g + 1) * rows)
                for g in range(first, last) for start, rows in zip(starts, self.part_rows)]


@dataclass(frozen=True)
class VocabSplit:
    """[vocab, hidden] padded to ``padded`` rows and split along dim 0; padding rows hold no HF data."""

    tensor: HFTensor
    padded: int
    split_dim = 0

    def tensors(self) -> tuple[HFTensor, ...]:
        return (self.tensor,)

    def local_rows(self, parts: int) -> int:
        if self.padded % parts:
            raise ValueError(f"{self.tensor.name}: padded vocabulary {self.padded} is not divisible by {parts} ranks")
        return self.padded // parts

    def blocks(self, parts: int, rank: int) -> list[Block]:
        rows = self.local_rows(parts)
        start, stop = rank * rows, min((rank + 1) * rows, self.tensor.shape[0])
        return [Block(self.tensor, start, stop)] if start < stop else []


Mapping = Replicated | Split | FusedQKV | GatedQKV | FusedGateUp | HeadGroups | VocabSplit


def renamed(mapping, rename):
    """``mapping`` with the name of each of its HF tensors passed through ``rename`` (shapes and splits kept)."""
    changes = {}
    for f in fields(mapping):
        value = getattr(mapping, f.name)
        if isinstance(value, HFTensor):
            changes[f.name] = HFTensor(rename(value.name), value.shape)
    return replace(mapping, **changes)
