"""Moving a model's weights, gradients and optimizer state off the device between phases, and back.

verl's ``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``: while the rollout
engines generate (or another model computes), the trainer's state of the model that is not in use
lives in host memory. The mechanism works on *storages*, the memory blocks under tensors:

* offload: each storage on the compute device is copied into a host buffer (page-locked with
  CUDA), every known tensor viewing it is re-pointed to the same bytes in the host buffer
  (``tensor.data = host view``), and the device storage is resized to 0, which frees its memory;
* reload: the device storage is resized back, the bytes are copied in, and every re-pointed tensor
  gets its device view back.

Tensor *objects* never change, so whatever holds them (the optimizer's param groups and state,
megatron's DDP buckets and ``main_grad`` views, the distributed optimizer's shard lists) keeps
working; views that were not re-pointed (DDP's bucket views) are valid again after the reload
because the storage itself is the same object. While offloaded, the re-pointed tensors are
ordinary host tensors: a checkpoint can be written from them without moving anything back.

Gradients are *discarded*, not copied: between two updates they are dead (every mini-batch starts
by zeroing the DDP grad buffers), so offloading frees the buffers and reloading re-creates them
zeroed, as verl does.

megatron-core 0.16.1 has similar helpers (``DistributedDataParallel.offload_grad_buffers``,
``MegatronOptimizer.offload_to_cpu``), but they act only on ``is_cuda`` tensors and call
the CUDA runtime directly, and the optimizer one replaces the state tensors instead of keeping them.
This module touches only storages on ``platform.device()``, so on a CPU machine (where that is the
CPU) the very same code path runs and can be tested: storages are freed and restored bit for bit.

``model_offload_groups`` names the three kinds of state of one model; ``Residency`` keeps track of
which groups are on the device and moves the least for each phase (``need``).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Sequence

import torch

from megarl import platform

logger = logging.getLogger(__name__)

Tensors = Callable[[], Iterable[torch.Tensor]]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _same_place(tensor: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A view of ``storage`` with ``tensor``'s dtype, offset, shape and strides."""
    view = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    return view.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


class OffloadGroup:
    """Storages that leave the device together: one kind of state (weights, grads, optimizer) of one model.

    ``owners()`` lists the tensors whose storages belong to the group (read at every offload, so
    state created later, such as Adam moments, is included); ``aliases()`` lists every tensor that
    may view those storages and must stay usable while offloaded (re-pointed to host memory).
    ``exclude()`` names storages that belong to another group (the distributed optimizer's fp32
    shards of fp32 weights are views of the weights). ``keep_values=False`` discards the bytes
    (gradients). Host buffers are allocated once and reused.
    """

    def __init__(self, name: str, owners: Tensors, aliases: Tensors = list, keep_values: bool = True,
                 exclude: Callable[[], set[int]] = set):
        self.name, self.keep_values = name, keep_values
        self._owners, self._aliases, self._exclude = owners, aliases, exclude
        self._moved: list[tuple[torch.UntypedStorage, int]] = []  # (device storage, its bytes)
        self._repointed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its device view)
        self._host: dict[int, torch.Tensor] = {}  # device storage key -> host buffer
        self.resident = True

    def _device_storages(self) -> list[torch.UntypedStorage]:
        """The group's distinct non-empty storages on the compute device."""
        device_type, excluded, found = platform.device().type, self._exclude(), {}
        for tensor in self._owners():
            storage = tensor.untyped_storage()
            key = storage._cdata
            if storage.device.type == device_type and storage.nbytes() and key not in excluded:
                found.setdefault(key, storage)
        return list(found.values())

    def offload(self) -> int:
        """Move (or discard) the group's device storages; returns the bytes freed on the device."""
        if not self.resident:
            return 0
        storages = self._device_storages()
        by_key = {s._cdata: s for s in storages}
        self._host = {key: buffer for key, buffer in self._host.items() if key in by_key}  # storages since replaced
        for storage in storages:
            if self.keep_values:
                host = self._host.get(storage._cdata)
                if host is None or host.numel() != storage.nbytes():
                    host = self._host[storage._cdata] = platform.host_buffer(storage.nbytes())
                host.copy_(_bytes_of(storage), non_blocking=True)
        platform.synchronize()  # the copies must land before the device memory is given back
        if self.keep_values:
            for tensor in self._aliases():
                key = _storage_key(tensor)
                if key in by_key:
                    self._repointed.append((tensor, tensor.data))
                    tensor.data = _same_place(tensor, self._host[key].untyped_storage())
        freed = 0
        for storage in storages:
            self._moved.append((storage, storage.nbytes()))
            freed += storage.nbytes()
            storage.resize_(0)
        self.resident = False
        return freed

    def reload(self) -> int:
        """Re-create the device storages (with their bytes, or zeroed); returns the bytes allocated."""
        if self.resident:
            return 0
        allocated = 0
        for storage, nbytes in self._moved:
            storage.resize_(nbytes)
            if self.keep_values:
                _bytes_of(storage).copy_(self._host[storage._cdata], non_blocking=True)
            else:
                _bytes_of(storage).zero_()
            allocated += nbytes
        for tensor, device_view in self._repointed:
            tensor.data = device_view
        platform.synchronize()
        self._moved, self._repointed = [], []
        self.resident = True
        return allocated


def _inner_optimizers(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer]) if getattr(o, "optimizer", None)]


def model_offload_groups(model_chunks: Sequence[torch.nn.Module], optimizer=None) -> dict[str, OffloadGroup]:
    """``params``, and for a trained model (mcore DDP chunks and a megatron optimizer) ``grads`` and
    ``optimizer`` (fp32 master weights, Adam moments and step counts)."""
    chunks = list(model_chunks)

    def params():
        return [p for chunk in chunks for p in chunk.parameters()]

    def main_params():
        return [p for inner in _inner_optimizers(optimizer) for group in inner.param_groups for p in group["params"]]

    def optimizer_state():
        return [value for inner in _inner_optimizers(optimizer) for state in inner.state.values()
                for value in state.values() if torch.is_tensor(value)]

    def every_tensor():
        return params() + (main_params() + optimizer_state() if optimizer is not None else [])

    from megatron.core.distributed import DistributedDataParallel

    groups = {"params": OffloadGroup("params", params, every_tensor)}
    buffers = [b for chunk in chunks if isinstance(chunk, DistributedDataParallel)
               for b in chunk.buffers + chunk.expert_parallel_buffers]
    if buffers:
        groups["grads"] = OffloadGroup("grads", lambda: [b.grad_data for b in buffers], keep_values=False)
    if optimizer is not None:
        groups["optimizer"] = OffloadGroup("optimizer", lambda: main_params() + optimizer_state(), every_tensor,
                                           exclude=lambda: {_storage_key(p) for p in params()})
    return groups


class Residency:
    """Which offloadable groups are on the device; ``need(names)`` makes exactly those resident.

    Only groups whose offload is switched on are registered: everything else always stays on the
    device. ``need`` first offloads the registered groups a phase does not name (freeing memory),
    then reloads the ones it names. It logs what it moved with the device memory before and after
    (INFO the first time each group moves either way, DEBUG afterwards).
    """

    def __init__(self, groups: dict[str, OffloadGroup], rank: int = 0):
        self.groups, self.rank = dict(groups), rank
        self._logged: set[str] = set()

    def need(self, names: Iterable[str], phase: str) -> None:
        wanted = set(names)
        leaving = [n for n, g in self.groups.items() if g.resident and n not in wanted]
        coming = [n for n, g in self.groups.items() if not g.resident and n in wanted]
        if not leaving and not coming:
            return
        before, start = platform.memory_stats()["allocated_bytes"], time.perf_counter()
        freed = sum(self.groups[n].offload() for n in leaving)
        allocated = sum(self.groups[n].reload() for n in coming)
        after = platform.memory_stats()["allocated_bytes"]
        moves = {f"{n} out" for n in leaving} | {f"{n} in" for n in coming}
        first = not moves <= self._logged
        self._logged |= moves
        if self.rank == 0:
            logger.log(logging.INFO if first else logging.DEBUG,
                       "offload (%s): %s to host (%.1f MiB), %s to the device (%.1f MiB) in %.2f s; "
                       "device memory %.2f -> %.2f GiB", phase, ", ".join(leaving) or "nothing", freed / 2**20,
                       ", ".join(coming) or "nothing", allocated / 2**20, time.perf_counter() - start,
                       before / 2**30, after / 2**30)

    def resident(self) -> dict[str, bool]:
        return {name: group.resident for name, group in self.groups.items()}

    @contextmanager
    def also(self, names: Iterable[str], phase: str):
        """Make ``names`` resident too for the duration, then return to what was resident before."""
        before = [name for name, group in self.groups.items() if group.resident]
        self.need([*before, *names], phase)
        try:
            yield
        finally:
            self.need(before, f"after {phase}")
