"""Which peers are still alive: a heartbeat counter per rank in the sync store.

Every participant bumps ``alive/<rank>`` once per ``period`` from a background thread with its
own store connection. When a sync fails, the failing rank reads its peers' counters twice,
``2.5 * period`` apart: a peer whose counter did not move has died (or is frozen). The error
then names that rank instead of only the route; gloo's own message names just an address.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_PERIOD_S = 1.0
FAILURE_GRACE_S = 3 * HEARTBEAT_PERIOD_S + 5.0  # how long the store host stays up for peers of a failed sync


def _key(rank: int) -> str:
    return f"alive/{rank}"


class Heartbeat:
    """Bumps this rank's counter every ``period`` seconds until ``stop()``."""

    def __init__(self, master_addr: str, master_port: int, rank: int, period: float = HEARTBEAT_PERIOD_S) -> None:
        self._store = dist.TCPStore(master_addr, int(master_port), is_master=False,
                                    timeout=timedelta(seconds=max(10.0, 5 * period)), wait_for_workers=False)
        self._rank, self._period = rank, period
        self._stopped = threading.Event()
        self._store.add(_key(rank), 1)
        self._thread = threading.Thread(target=self._beat, name=f"weight-sync-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._period):
            try:
                self._store.add(_key(self._rank), 1)
            except Exception:  # noqa: BLE001 - the store host is gone; the sync itself reports that
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * self._period)


def silent_peers(store: dist.Store, peers: list[int], period: float = HEARTBEAT_PERIOD_S) -> list[int] | None:
    """Peers whose heartbeat stopped (dead or frozen); None if the store itself is unreachable."""
    try:
        before = [store.add(_key(r), 0) for r in peers]
        time.sleep(2.5 * period)
        after = [store.add(_key(r), 0) for r in peers]
    except Exception:  # noqa: BLE001 - the store host (sync rank 0) is gone
        return None
    return [r for r, b, a in zip(peers, before, after) if a == b]


def describe_silent(store: dist.Store | None, peers: list[int]) -> str:
    """A phrase for an error message: which of ``peers`` stopped beating."""
    if store is None or not peers:
        return ""
    silent = silent_peers(store, peers)
    if silent is None:
        return "; the sync store (hosted by sync rank 0) is unreachable, so rank 0 is likely dead"
    if not silent:
        return "; all of them are still alive (heartbeat), so one is stalled or the network failed"
    return f"; silent peer ranks (no heartbeat, dead or frozen): {silent}"
