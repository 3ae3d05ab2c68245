"""What cuda_ipc reads from the sync store is checked data, never unpickled.

The protocol itself (real processes, host shared memory) runs in ``test_transport.py`` (phase ``ipc``).
"""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from megarl.weight_sync.transport import ipc_handles
from megarl.weight_sync.transport.cuda_ipc import _CudaIpcBuffers, _HostSharedBuffers


class _Planted:
    """Unpickling this writes a file: what a store client could make a receiver run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_handle_is_refused_unrun(tmp_path):
    planted = tmp_path / "ran"
    for buffers in (_HostSharedBuffers(), _CudaIpcBuffers()):
        with pytest.raises(ipc_handles.HandleError, match="not a megarl-ipc-1 handle"):
            buffers.open(pickle.dumps(_Planted(str(planted))))
        assert not planted.exists(), "the receiver ran code from the store"


def test_host_handles_round_trip_and_share_memory():
    sender = _HostSharedBuffers()
    buffer, handle = sender.allocate(64)
    try:
        assert json.loads(handle)["kind"] == "host"
        buffer[:] = torch.arange(64, dtype=torch.uint8)
        seen = _HostSharedBuffers().open(handle)
        assert torch.equal(seen, buffer)
        buffer[0] = 200
        assert int(seen[0]) == 200  # one memory, not a copy
    finally:
        sender.release()


def host_handle(**fields) -> bytes:
    return json.dumps({"format": ipc_handles.FORMAT, "kind": "host", **fields}).encode()


def test_host_handles_name_only_this_transports_files(tmp_path):
    sender = _HostSharedBuffers()
    _, handle = sender.allocate(64)
    path = json.loads(handle)["path"]
    try:
        for bad, reason in ((host_handle(path="/etc/passwd", nbytes=8), "is not a /dev/shm/megarl-sync-"),
                            (host_handle(path="/dev/shm/megarl-sync-1-../../etc/passwd", nbytes=8), "is not a"),
                            (host_handle(path=path, nbytes=1 << 20), "at least 1048576 bytes"),
                            (host_handle(path=path, nbytes=-1), "nbytes=-1 is not a count"),
                            (host_handle(path=path, nbytes=8, extra=1), "fields"),
                            (b"\x80\x04junk", "not a megarl-ipc-1 handle")):
            with pytest.raises(ipc_handles.HandleError, match=reason.replace("(", r"\(")):
                _HostSharedBuffers().open(bad)
        link = f"{ipc_handles.HOST_PREFIX}{os.getpid()}-{'0' * 32}"
        os.symlink(path, link)
        try:
            with pytest.raises(ipc_handles.HandleError, match="not a regular file"):
                _HostSharedBuffers().open(host_handle(path=link, nbytes=8))
        finally:
            os.unlink(link)
    finally:
        sender.release()


def cuda_fields(**changes) -> dict:
    fields = {"format": ipc_handles.FORMAT, "kind": "cuda", "device": 0, "handle": "ab" * 64, "storage_size": 4096,
              "storage_offset": 0, "ref_counter_handle": b"/torch_1_2".hex(), "ref_counter_offset": 0,
              "event_handle": "cd" * 64, "event_sync_required": True, "nbytes": 1024}
    fields.update(changes)
    return fields


def test_cuda_handles_are_plain_checked_fields():
    found = ipc_handles.decode(json.dumps(cuda_fields()).encode())
    assert found == ipc_handles.CudaHandle(device=0, handle=b"\xab" * 64, storage_size=4096, storage_offset=0,
                                           ref_counter_handle=b"/torch_1_2", ref_counter_offset=0,
                                           event_handle=b"\xcd" * 64, event_sync_required=True, nbytes=1024)
    for changes, reason in (({"device": -1}, "device=-1 is not a count"), ({"nbytes": 1.5}, "not a count"),
                            ({"handle": "zz"}, "handle is not hex"), ({"handle": "00" * 5000}, "at most 4096"),
                            ({"event_sync_required": "yes"}, "not a boolean"), ({"kind": "tensor"}, "unknown handle kind")):
        with pytest.raises(ipc_handles.HandleError, match=reason):
            ipc_handles.decode(json.dumps(cuda_fields(**changes)).encode())
    if not torch.cuda.is_available():
        with pytest.raises(ipc_handles.HandleError, match="this process sees 0"):
            ipc_handles.open_cuda(found)


def _consume(handle: bytes, results) -> None:
    view = _CudaIpcBuffers().open(handle)
    total = int(view.sum())
    view[0] = 77
    torch.cuda.synchronize()
    results.put(total)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (the CPU variant is tested above)")
@pytest.mark.heavy  # a consumer process
def test_a_cuda_handle_maps_the_same_memory_in_another_process():
    import multiprocessing as mp

    buffer, handle = _CudaIpcBuffers().allocate(1024)
    buffer.copy_(torch.arange(1024, device=buffer.device) % 251)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(handle, results))
    consumer.start()
    total = results.get(timeout=120)
    consumer.join(60)
    assert consumer.exitcode == 0
    assert total == int((torch.arange(1024) % 251).sum())
    assert int(buffer[0]) == 77  # the other process wrote into this buffer
