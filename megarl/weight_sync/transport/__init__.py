"""Weight-sync transports behind one interface (``base.Transport``), one module per mode.

Each is a registry entry (class path and traits: ``needs_gpu``, ``default_on_gpu`` /
``default_on_cpu`` for ``transport=auto``); ``make_transport("gloo" | "nccl" | "cuda_ipc", window=2)``
builds one by name. A new transport is one module and one ``TRANSPORTS.register`` line.
"""
from __future__ import annotations

import importlib

from megarl.config.registry import Registry
from megarl.weight_sync.transport.base import OnBucket, SyncStats, Transport

TRANSPORTS = Registry("weight-sync transport", "actor_rollout_ref.rollout.weight_sync.transport",
                      traits={"needs_gpu": False, "default_on_gpu": False, "default_on_cpu": False})
TRANSPORTS.register("gloo", default_on_cpu=True)("megarl.weight_sync.transport.gloo:GlooTransport")
TRANSPORTS.register("nccl", needs_gpu=True, default_on_gpu=True)("megarl.weight_sync.transport.nccl:NcclTransport")
TRANSPORTS.register("cuda_ipc", needs_gpu=True)("megarl.weight_sync.transport.cuda_ipc:CudaIpcTransport")


def make_transport(name: str, window: int = 2) -> Transport:
    """The transport called ``name`` with ``window`` buckets in flight per rank."""
    module, _, cls = TRANSPORTS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(window)


def choose_transport(name: str, use_gpu: bool) -> str:
    """``name``, or for ``auto`` the default of the devices; a GPU-only transport on CPU is an error."""
    if name == "auto":
        return next(n for n in TRANSPORTS if TRANSPORTS.traits(n)["default_on_gpu" if use_gpu else "default_on_cpu"])
    if TRANSPORTS.traits(name)["needs_gpu"] and not use_gpu:
        gpu_free = sorted(TRANSPORTS.having(needs_gpu=False))
        raise ValueError(f"actor_rollout_ref.rollout.weight_sync.transport={name!r} needs GPUs; use auto or one of {gpu_free}")
    return name


__all__ = ["OnBucket", "SyncStats", "TRANSPORTS", "Transport", "choose_transport", "make_transport"]
