"""Weight-sync transports behind one interface (``base.Transport``), one module per mode.

``make_transport("gloo" | "nccl" | "cuda_ipc", window=2)`` builds one by name.
"""
from __future__ import annotations

from megarl.weight_sync.transport.base import OnBucket, SyncStats, Transport

TRANSPORTS = ("gloo", "nccl", "cuda_ipc")


def make_transport(name: str, window: int = 2) -> Transport:
    """The transport called ``name`` with ``window`` buckets in flight per rank."""
    if name == "gloo":
        from megarl.weight_sync.transport.gloo import GlooTransport
        return GlooTransport(window)
    if name == "nccl":
        from megarl.weight_sync.transport.nccl import NcclTransport
        return NcclTransport(window)
    if name == "cuda_ipc":
        from megarl.weight_sync.transport.cuda_ipc import CudaIpcTransport
        return CudaIpcTransport(window)
    raise ValueError(f"unknown weight-sync transport {name!r}; choose one of {TRANSPORTS}")


__all__ = ["OnBucket", "SyncStats", "TRANSPORTS", "Transport", "make_transport"]
