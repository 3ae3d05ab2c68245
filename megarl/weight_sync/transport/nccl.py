"""The NCCL transport: buckets GPU to GPU, one NCCL communicator per route.

Same schedule and windowing as gloo (``collective.CollectiveTransport``); the bucket buffers live
on this process's GPU (``megarl.platform.device()``), so packing, the broadcast and unpacking
never touch the host. Each route's communicator has its own CUDA stream, so routes with
different sources overlap on the wire; ``work.wait(timeout)`` blocks the host until the
broadcast is done or the timeout passes (then the communicator is aborted and a ``SyncError``
names the route).

NCCL gets the packed protocol (``per_region = False``: one broadcast per bucket; packing and
unpacking run on the GPU at memory bandwidth). Untested on the CPU-only development machines (it
needs CUDA and NCCL); the protocol it runs is tested over gloo with real processes (the
``broadcast`` phases of ``tests/weight_sync/test_transport.py``).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megarl import platform
from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.planner import SyncPlan
from megarl.weight_sync.transport.collective import CollectiveTransport


class NcclTransport(CollectiveTransport):
    name = "nccl"

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, plan: SyncPlan,
                timeout_s: float = 300.0) -> None:
        if not platform.has_cuda() or not dist.is_nccl_available():
            raise SyncError("the nccl weight-sync transport needs CUDA and a torch built with NCCL; "
                            "use transport 'gloo' on CPU machines")
        super().connect(rank, world_size, master_addr, master_port, plan, timeout_s)

    def _new_group(self, store: dist.Store, group_rank: int, group_size: int, timeout: timedelta):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, group_rank, group_size, options)

    def _device(self) -> torch.device:
        return platform.device()
