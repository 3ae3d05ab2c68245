"""A bucket on the wire: the bytes of its transfers' regions, concatenated in plan order.

Both sides compute the same plan, so a bucket carries no header: transfer ``k`` of a bucket
occupies bytes ``[offset_k, offset_k + nbytes_k)`` where the offsets are the running sum of the
plan's ``Transfer.nbytes``. Each region is laid out C-contiguous in its tensor's dtype
(``TensorMeta.dtype``); mixed dtypes share one ``uint8`` buffer.

A bucket of a single transfer needs no packing at all when the region is contiguous memory on
both sides (``as_bytes``): the source sends straight from its tensor and the receiver can receive
straight into its destination. Large tensors are split into single-transfer row-chunk buckets
by the planner, so this covers most of the bytes.

A region whose offset is a multiple of its element size is written and read through a typed
view of the buffer (no extra copy). Mixed dtypes can leave an odd offset (a bf16 region of odd
length followed by fp32); such a region is copied byte-wise instead, so the wire format never
needs padding and a bucket is exactly ``Bucket.nbytes`` long.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from megarl.weight_sync.planner import Bucket, TensorMeta, Transfer
from megarl.weight_sync.regions import Region, region_shape

GetRegion = Callable[[str, Region], torch.Tensor]


def torch_dtype(meta: TensorMeta, name: str = "") -> torch.dtype:
    """The torch dtype named by ``meta.dtype`` ("float32", "bfloat16", ...), checked against ``itemsize``."""
    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {name!r}: TensorMeta.dtype={meta.dtype!r} is not a torch dtype name "
                         f"(use e.g. 'float32' or 'bfloat16')")
    if dtype.itemsize != meta.itemsize:
        raise ValueError(f"tensor {name!r}: TensorMeta.itemsize={meta.itemsize} but {meta.dtype} has "
                         f"{dtype.itemsize} bytes per element; make them agree")
    return dtype


def as_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor's memory as a flat ``uint8`` view, or None when it is not contiguous."""
    if not tensor.is_contiguous():
        return None
    return tensor.reshape(-1).view(torch.uint8)


def is_contiguous_block(region: Region, shape: tuple[int, ...]) -> bool:
    """True when ``region`` is one C-contiguous block of a tensor of ``shape`` (e.g. full rows).

    That is: the dims before the first one wider than 1 have width 1, and every dim after it is full.
    """
    widths = [stop - start for start, stop in region]
    first = next((d for d, w in enumerate(widths) if w > 1), len(widths))
    return all(widths[d] == shape[d] for d in range(first + 1, len(shape)))


def offsets(bucket: Bucket) -> list[int]:
    """Byte offset of each transfer of ``bucket`` in its packed buffer."""
    out, position = [], 0
    for transfer in bucket.transfers:
        out.append(position)
        position += transfer.nbytes
    return out


def _typed(buffer: torch.Tensor, offset: int, transfer: Transfer, dtype: torch.dtype) -> torch.Tensor | None:
    """A view of the transfer's bytes as a ``dtype`` tensor of the region's shape, or None if misaligned."""
    if (buffer.storage_offset() + offset) % dtype.itemsize:
        return None
    return buffer[offset:offset + transfer.nbytes].view(dtype).view(region_shape(transfer.region))


def check_piece(transfer: Transfer, meta: Mapping[str, TensorMeta], piece: torch.Tensor) -> torch.Tensor:
    """``piece`` if it has the transfer's region shape and the tensor's dtype, else a ValueError."""
    dtype = torch_dtype(meta[transfer.name], transfer.name)
    if tuple(piece.shape) != region_shape(transfer.region) or piece.dtype != dtype:
        raise ValueError(f"get_region({transfer.name!r}, {list(transfer.region)}) returned "
                         f"{piece.dtype} {tuple(piece.shape)}; the plan expects {dtype} "
                         f"{region_shape(transfer.region)}")
    return piece


def pack_bucket(bucket: Bucket, meta: Mapping[str, TensorMeta], get_region: GetRegion,
                out: torch.Tensor) -> torch.Tensor:
    """Write every transfer's region (read with ``get_region(name, region)``) into ``out``; return the used part.

    ``out`` is a 1-D ``uint8`` tensor of at least ``bucket.nbytes`` bytes (reused across buckets).
    """
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < bucket.nbytes:
        raise ValueError(f"pack buffer must be 1-D uint8 with >= {bucket.nbytes} bytes, got "
                         f"{out.dtype} {tuple(out.shape)}")
    for transfer, offset in zip(bucket.transfers, offsets(bucket)):
        dtype = torch_dtype(meta[transfer.name], transfer.name)
        piece = check_piece(transfer, meta, get_region(transfer.name, transfer.region))
        typed = _typed(out, offset, transfer, dtype)
        if typed is not None:
            typed.copy_(piece)
        else:
            out[offset:offset + transfer.nbytes].copy_(piece.contiguous().view(-1).view(torch.uint8))
    return out[:bucket.nbytes]


def region_view(buffer: torch.Tensor, offset: int, transfer: Transfer, meta: Mapping[str, TensorMeta]) -> torch.Tensor:
    """The transfer's bytes at ``buffer[offset:]`` as a tensor of its region's shape and dtype.

    A view when aligned (valid until the buffer is reused), else a copy.
    """
    dtype = torch_dtype(meta[transfer.name], transfer.name)
    typed = _typed(buffer, offset, transfer, dtype)
    if typed is None:
        raw = buffer[offset:offset + transfer.nbytes].clone()
        typed = raw.view(dtype).view(region_shape(transfer.region))
    return typed


def piece_bytes(transfer: Transfer, meta: Mapping[str, TensorMeta], piece: torch.Tensor,
                staging: torch.Tensor, offset: int) -> torch.Tensor:
    """The bytes to send for one region: the piece's own memory if contiguous (on the staging
    buffer's device type), else a copy written into ``staging[offset:]``."""
    piece = check_piece(transfer, meta, piece)
    direct = as_bytes(piece) if piece.device.type == staging.device.type else None
    if direct is not None:
        return direct
    typed = _typed(staging, offset, transfer, piece.dtype)
    if typed is not None:
        typed.copy_(piece)
    else:
        staging[offset:offset + transfer.nbytes].copy_(piece.contiguous().view(-1).view(torch.uint8))
    return staging[offset:offset + transfer.nbytes]


def unpack_bucket(bucket: Bucket, meta: Mapping[str, TensorMeta],
                  buffer: torch.Tensor) -> list[tuple[Transfer, torch.Tensor]]:
    """Split a received buffer into one tensor per transfer (region shape, tensor dtype).

    Aligned regions are views into ``buffer`` (valid until the buffer is reused); misaligned ones
    are copies.
    """
    if buffer.numel() < bucket.nbytes:
        raise ValueError(f"received buffer has {buffer.numel()} bytes, bucket needs {bucket.nbytes}")
    return [(transfer, region_view(buffer, offset, transfer, meta))
            for transfer, offset in zip(bucket.transfers, offsets(bucket))]
