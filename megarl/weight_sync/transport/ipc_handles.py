"""The handles ``cuda_ipc`` publishes in the sync store: a fixed format, checked, never unpickled.

A source shares each bucket buffer by writing a handle to the sync store; every destination reads it
and maps the buffer. The store is a network service (it listens on the cluster address), so what a
destination reads there is data to check, not code: ``pickle.loads`` would run whatever callable the
bytes name. A handle is JSON with fixed fields; ``decode`` checks each one (type, range, length)
and the buffer is rebuilt from those values alone.

CUDA: the fields of torch's own CUDA IPC reduction of the buffer's storage (``_share_cuda_()``, what
``torch.multiprocessing.reductions.reduce_tensor`` sends for a CUDA tensor): the device index, the
``cudaIpcMemHandle`` bytes, the allocation's size and the storage's offset in it, the reference
counter's shared-memory file and offset, the IPC event handle and whether to wait on it. A buffer is
always a flat ``uint8`` tensor of ``nbytes``; ``open_cuda`` rebuilds it with torch's
``rebuild_cuda_tensor`` and those explicit arguments.

Host shared memory (machines without CUDA): the path of a ``/dev/shm/megarl-sync-<pid>-<hex>``
file made by this transport and its size; ``open_host`` maps it only if it is such a file, a
regular one of this user, at least ``nbytes`` long.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass

import torch

from megarl.platform.hardware import device_count

FORMAT = "megarl-ipc-1"
HOST_PREFIX = "/dev/shm/megarl-sync-"
_HOST_PATH = re.compile(r"/dev/shm/megarl-sync-\d+-[0-9a-f]{32}")
_MAX_HANDLE_BYTES = 4096  # a cudaIpcMemHandle is 64 bytes, the counter's file name a few dozen
_CUDA_BYTES = ("handle", "ref_counter_handle", "event_handle")
_CUDA_INTS = ("device", "storage_size", "storage_offset", "ref_counter_offset", "nbytes")


class HandleError(ValueError):
    """A handle read from the sync store is not one this transport wrote."""


@dataclass(frozen=True)
class CudaHandle:
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int


@dataclass(frozen=True)
class HostHandle:
    path: str
    nbytes: int


def encode_cuda(buffer: torch.Tensor) -> bytes:
    """The handle of a flat ``uint8`` CUDA buffer (registers it for IPC, as ``reduce_tensor`` does)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.storage_offset() != 0 or not buffer.is_cuda:
        raise ValueError("cuda_ipc shares flat uint8 CUDA buffers that start their storage")
    (device, handle, size, offset, counter, counter_offset, event,
     event_sync) = buffer.untyped_storage()._share_cuda_()
    return _dump({"kind": "cuda", "device": int(device), "handle": handle.hex(), "storage_size": int(size),
                  "storage_offset": int(offset), "ref_counter_handle": counter.hex(),
                  "ref_counter_offset": int(counter_offset), "event_handle": (event or b"").hex(),
                  "event_sync_required": bool(event_sync), "nbytes": buffer.numel()})


def encode_host(path: str, nbytes: int) -> bytes:
    return _dump({"kind": "host", "path": path, "nbytes": int(nbytes)})


def decode(raw: bytes) -> CudaHandle | HostHandle:
    """Parse and check a handle; ``HandleError`` names what is wrong."""
    try:
        fields = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandleError(f"not a {FORMAT} handle ({len(raw)} bytes): {exc}") from None
    if not isinstance(fields, dict) or fields.get("format") != FORMAT:
        raise HandleError(f"not a {FORMAT} handle: format {fields.get('format') if isinstance(fields, dict) else None!r}")
    kind = fields.get("kind")
    if kind == "host":
        _only(fields, {"path", "nbytes"})
        path = fields["path"]
        if not isinstance(path, str) or not _HOST_PATH.fullmatch(path):
            raise HandleError(f"host handle path {path!r} is not a {HOST_PREFIX}<pid>-<hex> file")
        return HostHandle(path, _count(fields, "nbytes"))
    if kind == "cuda":
        _only(fields, set(_CUDA_BYTES) | set(_CUDA_INTS) | {"event_sync_required"})
        if not isinstance(fields["event_sync_required"], bool):
            raise HandleError("cuda handle field event_sync_required is not a boolean")
        return CudaHandle(**{k: _count(fields, k) for k in _CUDA_INTS}, **{k: _hex(fields, k) for k in _CUDA_BYTES},
                          event_sync_required=fields["event_sync_required"])
    raise HandleError(f"unknown handle kind {kind!r}")


def open_host(h: HostHandle) -> torch.Tensor:
    """Map a host handle's file: a regular file of this user, not a link, at least ``nbytes`` long."""
    try:
        info = os.lstat(h.path)
    except OSError as exc:
        raise HandleError(f"host handle {h.path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size < h.nbytes:
        raise HandleError(f"host handle {h.path}: not a regular file of this user of at least {h.nbytes} bytes")
    return torch.from_file(h.path, shared=True, size=h.nbytes, dtype=torch.uint8)


def open_cuda(h: CudaHandle) -> torch.Tensor:
    """Map a CUDA handle's buffer into this process (torch's own rebuild, explicit arguments)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if h.device >= device_count():
        raise HandleError(f"cuda handle names device {h.device}; this process sees {device_count()}")
    if h.nbytes == 0 or h.nbytes > h.storage_size:
        raise HandleError(f"cuda handle: a buffer of {h.nbytes} bytes in a storage of {h.storage_size}")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([h.nbytes]), (1,), 0, torch.UntypedStorage, torch.uint8,
                               h.device, h.handle, h.storage_size, h.storage_offset, False, h.ref_counter_handle,
                               h.ref_counter_offset, h.event_handle or None, h.event_sync_required)


def _dump(fields: dict) -> bytes:
    return json.dumps({"format": FORMAT, **fields}, sort_keys=True).encode()


def _only(fields: dict, names: set[str]) -> None:
    got = set(fields) - {"format", "kind"}
    if got != names:
        raise HandleError(f"{fields['kind']} handle fields {sorted(got)}; expected {sorted(names)}")


def _count(fields: dict, name: str) -> int:
    value = fields[name]
    if type(value) is not int or value < 0:
        raise HandleError(f"{fields['kind']} handle field {name}={value!r} is not a count")
    return value


def _hex(fields: dict, name: str) -> bytes:
    value = fields[name]
    if not isinstance(value, str) or len(value) > 2 * _MAX_HANDLE_BYTES:
        raise HandleError(f"{fields['kind']} handle field {name} is not a hex string of at most {_MAX_HANDLE_BYTES} bytes")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise HandleError(f"{fields['kind']} handle field {name} is not hex") from None
