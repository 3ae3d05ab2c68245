"""The gloo transport: buckets through host memory over TCP; the CPU path and the fallback on GPUs.

Regions travel one p2p message each (``per_region``), straight from and into host tensors where
they are contiguous. A trainer on GPUs still works: its regions are staged in the host buffer,
and the receiver copies them to wherever its tensors live.

All of a rank's route groups share one gloo device (one network event loop) and have one worker
thread each, which keeps the thread count low when a rank is on many routes. The interface is
picked like torch.distributed does: the first of ``GLOO_SOCKET_IFNAME`` if set, else the address
the hostname resolves to.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.weight_sync.transport.collective import CollectiveTransport


class GlooTransport(CollectiveTransport):
    name = "gloo"
    per_region = True  # zero-copy p2p per region: see collective.py

    def __init__(self, window: int = 2) -> None:
        super().__init__(window)
        self._gloo_device = None

    def _new_group(self, store: dist.Store, group_rank: int, group_size: int, timeout: timedelta):
        if self._gloo_device is None:  # one device (one network event loop) for all of this rank's routes
            interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
            self._gloo_device = (dist.ProcessGroupGloo.create_device(interface=interface) if interface
                                 else dist.ProcessGroupGloo.create_default_device())
        options = dist.ProcessGroupGloo._Options()
        options._devices = [self._gloo_device]
        options._threads = 1  # p2p ops bypass the worker threads; one per route serves the rest
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, group_rank, group_size, options)

    def _device(self) -> torch.device:
        return torch.device("cpu")
