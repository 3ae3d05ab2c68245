"""How a CPU replica stops its vLLM engine: quickly, and without leaving files on the machine.

An engine core needs 2-5 s to exit after vLLM's SIGTERM on 2 cores (gloo groups, gc, interpreter exit), on
every run's teardown; on CPU the replica gives it ``CPU_STOP_GRACE_S`` before vLLM kills it (GPUs keep vLLM's
default). A killed engine process must not leave tqdm's multiprocessing lock behind: in a spawned process
that is a named semaphore in /dev/shm. No process starts here: the engine is a stand-in that records how it
is stopped, and tqdm's lock is checked in this process.
"""
from __future__ import annotations

import asyncio

import pytest

from megarl.rollout.vllm import replica as replica_module


class RecordedEngine:
    def __init__(self):
        self.timeouts = []

    def shutdown(self, timeout=None):
        self.timeouts.append(timeout)


def stopped_with(on_gpu: bool) -> list:
    replica = object.__new__(replica_module.EngineReplica)  # the actor's state without starting an engine
    replica.http, replica.on_gpu, replica.engine = None, on_gpu, RecordedEngine()
    engine = replica.engine
    asyncio.run(replica.close())
    assert replica.engine is None
    return engine.timeouts


def test_a_cpu_engine_gets_a_short_grace_period_and_a_gpu_engine_vllms_default():
    assert stopped_with(on_gpu=False) == [replica_module.CPU_STOP_GRACE_S]
    assert 0 < replica_module.CPU_STOP_GRACE_S < 5
    assert stopped_with(on_gpu=True) == [None]


def test_engine_processes_draw_progress_bars_without_a_multiprocessing_lock(monkeypatch):
    import multiprocessing

    from tqdm import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    from megarl.rollout.vllm import worker_extension

    made = []

    def no_process_lock(*args, **kwargs):
        made.append("multiprocessing.RLock")
        raise AssertionError("tqdm took a multiprocessing lock")

    monkeypatch.delattr(tqdm, "_lock", raising=False)  # as in a fresh engine process, before any bar
    monkeypatch.delattr(TqdmDefaultWriteLock, "mp_lock", raising=False)
    monkeypatch.setattr(multiprocessing, "RLock", no_process_lock)
    worker_extension._thread_lock_for_progress_bars()
    for _ in tqdm(range(3), desc="Loading safetensors checkpoint shards", disable=True):
        pass
    assert made == []
    assert not hasattr(TqdmDefaultWriteLock, "mp_lock")
    # what tqdm's default lock does without it; its class method, not a bar: a bar would build the default lock,
    # whose constructor holds tqdm's class-wide thread lock across this raise and never releases it, and the
    # next bar of another thread in this process (tqdm's monitor) would wait for it forever (seen: a test
    # worker hung 10 minutes in a later module's save_pretrained)
    with pytest.raises(AssertionError, match="multiprocessing lock"):
        TqdmDefaultWriteLock.create_mp_lock()
    assert made == ["multiprocessing.RLock"]
    assert _free_for_another_thread(TqdmDefaultWriteLock.th_lock)


def _free_for_another_thread(lock) -> bool:
    import threading

    taken = []

    def take():
        if lock.acquire(timeout=5):
            taken.append(True)
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return bool(taken)
