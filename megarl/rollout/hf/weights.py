"""The hf backend's end of the weight sync: full HF tensors, by checkpoint name, into the live model.

The sync delivers tensors under their checkpoint names (``megarl.models.hf_tensor_shapes``). A
transformers model may store them differently: transformers 5 fuses the experts of an MoE layer
into one ``experts.gate_up_proj`` and one ``experts.down_proj`` and renames others (Mixtral's
``block_sparse_moe``). ``checkpoint_targets`` asks transformers itself where each checkpoint
tensor lives, once, at start: it reverts the model's own loading conversion
(``revert_weight_conversion``) on a tensor that holds each element's index, so every checkpoint
tensor comes back as the indices of the model elements it fills, and these are turned into a
strided view of the model tensor (an index list where no view fits). It checks that the
checkpoint tensors of every model tensor fill it exactly once. Tied embeddings are one model
tensor under two names; either name fills it.

``SyncReceiver`` is the replica's counterpart of vLLM's worker extension (``megarl_sync_*``):
it joins the sync world as one rank (no TP), checks at connect that the plan delivers a tensor
for every model tensor and nothing the model lacks, and on every sync streams each completed
tensor from megarl's ``WeightReceiver`` straight into its place.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from megarl.weight_sync.errors import SyncError


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor lives: a strided view of ``tensor``, or the flat ``index`` of its elements."""

    tensor: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    index: torch.Tensor | None = None

    def write(self, value: torch.Tensor) -> None:
        if tuple(value.shape) != self.size:
            raise SyncError(f"received a tensor of shape {tuple(value.shape)} for one of shape {self.size}")
        if self.index is not None:
            self.tensor.view(-1).index_copy_(0, self.index, value.reshape(-1).to(self.tensor.dtype))
            return
        self.tensor.as_strided(self.size, self.stride, self.tensor.storage_offset() + self.offset).copy_(value)


def _target(tensor: torch.Tensor, marker: torch.Tensor) -> Target:
    """The view of ``tensor`` whose elements are the flat indices held by ``marker``."""
    size = tuple(marker.shape)
    if marker.numel() == 0:
        return Target(tensor, size, tuple(1 for _ in size), 0)
    offset = int(marker.reshape(-1)[0])
    stride = []
    for dim, extent in enumerate(size):
        if extent == 1:
            stride.append(1)
            continue
        step = [0] * len(size)
        step[dim] = 1
        stride.append(int(marker[tuple(step)]) - offset)
    if all(s > 0 for s in stride):
        flat = torch.arange(tensor.numel(), dtype=torch.float64)
        if torch.equal(flat.as_strided(size, tuple(stride), offset), marker):
            return Target(tensor, size, tuple(stride), offset)
    return Target(tensor, size, tuple(stride), offset, index=marker.reshape(-1).long().to(tensor.device))


def _packed_parts(model) -> dict[str, list[tuple[str, int, Any]]]:
    """Checkpoint tensors that hold several of the bridge's tensors (gpt-oss's experts: ``FamilySpec.packed_tensors``)
    -> their parts ``(part name, row, view of the row)``; the sync sends the parts."""
    from megarl.models.families import family_for
    from megarl.models.packed import packed_parts

    family = family_for(model.config)
    by_packed: dict[str, list[tuple[str, int, Any]]] = {}
    if not family.packs_tensors:
        return by_packed
    for name, (packed, row, unpack) in packed_parts(family, family.read_dims(model.config)).items():
        by_packed.setdefault(packed.name, []).append((name, row, unpack))
    return by_packed


def _add_targets(targets: dict[str, Target], tensor: torch.Tensor, name: str, marker: torch.Tensor,
                 packed: dict[str, list]) -> list[str]:
    """The targets of checkpoint tensor ``name`` (the model elements ``marker`` holds), split into its parts if packed."""
    if name not in packed:
        targets[name] = _target(tensor, marker)
        return [name]
    for part, row, unpack in packed[name]:
        targets[part] = _target(tensor, unpack(marker[row]))
    return [part for part, _, _ in packed[name]]


def checkpoint_targets(model) -> tuple[dict[str, Target], list[list[str]]]:
    """``{checkpoint name: Target}`` for every tensor the model loads, and the names that fill each model
    tensor (one list per model tensor name; tied tensors have two lists, either complete one fills it).
    A packed checkpoint tensor is replaced by the parts the sync sends (``_packed_parts``)."""
    from transformers.core_model_loading import revert_weight_conversion

    packed = _packed_parts(model)
    targets: dict[str, Target] = {}
    groups: list[list[str]] = []
    for name, held in model.state_dict(keep_vars=True).items():
        tensor = held.data
        shapes = revert_weight_conversion(model, {name: torch.empty(tensor.shape, device="meta")})
        if list(shapes) == [name] and tuple(shapes[name].shape) == tuple(tensor.shape) and name not in packed:
            targets[name] = Target(tensor, tuple(tensor.shape), tuple(tensor.stride()), 0)
            groups.append([name])
            continue
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: a non-contiguous model tensor that transformers converts at load time; "
                             "the hf rollout backend cannot map the sync's tensors onto it")
        marker = torch.arange(tensor.numel(), dtype=torch.float64).view(tensor.shape)
        pieces = revert_weight_conversion(model, {name: marker})
        filled = torch.cat([m.reshape(-1) for m in pieces.values()]).sort().values
        if not torch.equal(filled, marker.reshape(-1)):
            raise ValueError(f"{name}: transformers' conversion of this tensor from its checkpoint tensors "
                             f"{sorted(pieces)[:4]} does not fill each element once; the hf rollout backend cannot "
                             "sync it")
        groups.append(sorted(part for piece, values in pieces.items()
                             for part in _add_targets(targets, tensor, piece, values, packed)))
    return targets, groups


class SyncReceiver:
    """One replica's receiving rank: its transport, plan and per-sync assembler, and the model's targets."""

    def __init__(self, model, device: torch.device):
        self.device = device
        self.targets, self.groups = checkpoint_targets(model)
        self.transport = self.receiver = None

    def connect(self, plan, first_rank: int, replica: int, world_size: int, master_addr: str, master_port: int,
                transport: str, timeout_s: float) -> int:
        """Join the weight-sync world as rank ``first_rank + replica``; return that rank."""
        from megarl.weight_sync.receiver import WeightReceiver
        from megarl.weight_sync.transport import make_transport

        self.close()
        rank = first_rank + replica
        receiver = WeightReceiver(plan, rank, device=self.device, recycle=True)
        self._check_plan(receiver.needed, rank)
        self.transport = make_transport(transport)
        self.transport.connect(rank, world_size, master_addr, master_port, plan, timeout_s)
        self.receiver = receiver
        return rank

    def _check_plan(self, needed: dict[str, Any], rank: int) -> None:
        unknown = sorted(set(needed) - set(self.targets))
        missing = [group[0] for group in self.groups
                   if not any(all(name in needed for name in g) for g in self._aliases(group))]
        problems = []
        if unknown:
            problems.append(f"the model has no tensor for {unknown[:6]}" + (f" and {len(unknown) - 6} more"
                                                                             if len(unknown) > 6 else ""))
        if missing:
            problems.append(f"nothing would update {sorted(missing)[:6]}")
        if problems:
            raise SyncError(f"sync rank {rank} (hf replica): the plan does not match the model: " + "; ".join(problems))

    def _aliases(self, group: list[str]) -> list[list[str]]:
        """The name lists that fill the same model tensor as ``group`` (tied weights)."""
        tensor = self.targets[group[0]].tensor
        return [g for g in self.groups if self.targets[g[0]].tensor.data_ptr() == tensor.data_ptr()]

    def receive(self) -> dict[str, float]:
        """Receive one sync into the model; raises (``SyncError``) unless every region arrived exactly once."""
        if self.receiver is None:
            raise RuntimeError("megarl_sync_receive before megarl_sync_connect")
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in self.receiver.receive(self.transport):
                self.targets[name].write(tensor)
        stats = self.receiver.last_stats
        return {"seconds": time.perf_counter() - start, "bytes": stats.bytes_received if stats is not None else 0}

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = self.receiver = None
