"""The endpoints own the sync's state: a replica's version moves only on a complete sync, and its
weights are stale (it refuses to generate) while one runs and after one failed."""
from __future__ import annotations

import asyncio

import pytest

from megarl.weight_sync.endpoints import ReceiverEndpoint, SenderEndpoint
from megarl.weight_sync.errors import SyncError


class FakeWorkers:
    """The TP workers behind ``collective_rpc``: each call gives one result per worker (2 here)."""

    def __init__(self):
        self.fail = None
        self.calls = []

    async def __call__(self, method, *args):
        self.calls.append(method)
        if method == "megarl_sync_receive":
            assert endpoint.stale and "in progress" in endpoint.stale  # stale while the bytes arrive
            if self.fail:
                raise SyncError(self.fail)
            return [{"seconds": 0.1, "bytes": 10}, {"seconds": 0.2, "bytes": 12}]
        return [5, 6]


endpoint: ReceiverEndpoint


def test_version_and_stale_state_follow_complete_syncs_only():
    global endpoint
    workers = FakeWorkers()
    endpoint = ReceiverEndpoint(3, workers)
    assert asyncio.run(endpoint.connect("plan", 4, 8, "127.0.0.1", 1, "gloo", 5)) == [5, 6]
    assert (endpoint.version, endpoint.stale) == (0, None)
    result = asyncio.run(endpoint.receive(1))
    assert (endpoint.version, endpoint.stale, result["bytes"], result["version"]) == (1, None, 22, 1)
    workers.fail = "rank 5: sync incomplete, 2 tensors missing"
    with pytest.raises(SyncError, match="incomplete"):
        asyncio.run(endpoint.receive(2))
    assert endpoint.version == 1 and "weight sync to version 2 failed: rank 5: sync incomplete" in endpoint.stale
    with pytest.raises(RuntimeError, match="replica 3 refuses to generate: weight sync to version 2 failed"):
        endpoint.check_fresh()
    workers.fail = None
    asyncio.run(endpoint.receive(3))  # a later sync succeeds: fresh again
    assert (endpoint.version, endpoint.stale) == (3, None)
    endpoint.check_fresh()
    with pytest.raises(SyncError, match="sync version 3 is not newer than the version it serves \\(3\\)"):
        asyncio.run(endpoint.receive(3))
    asyncio.run(endpoint.close())
    assert workers.calls[-1] == "megarl_sync_close" and endpoint.ranks == []


def test_a_sender_sends_only_after_connecting():
    sender = SenderEndpoint(0, lambda: {})
    assert sender.sources() == {"regions": {}, "dtypes": {}}
    with pytest.raises(SyncError, match="trainer sync rank 0: send before connect"):
        sender.send(1)
    sender.close()  # harmless twice
    sender.close()
