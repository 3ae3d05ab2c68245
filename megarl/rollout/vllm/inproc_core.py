"""vLLM's engine core inside the replica's own process, for ``AsyncLLM`` on CPU.

vLLM's ``AsyncLLM`` always runs its engine core in a child process (its in-process client serves the
synchronous ``LLMEngine`` only), and inside a Ray actor vLLM starts that child with spawn: a fresh
interpreter that imports torch, transformers and vLLM again, 7-8 CPU-s of every engine start on 2 cores
(measured), and an interpreter exit at every stop. On GPUs the separate process lets the scheduler work
while the GPU computes; on CPU the model's compute is CPU work either way. With
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM's own switch for an in-process engine core, which
``engine_config.replica_env`` sets for a TP=1 CPU replica), the replica builds its ``AsyncLLM`` with
``InprocAsyncClient``: vLLM's ``EngineCore`` in the actor's process, stepped by ``get_output_async`` while
it has requests, as vLLM's busy loop steps it in its process.

Everything else is vLLM's: ``AsyncLLM`` (requests, output processing, aborts, LoRA, collective RPCs) and
``EngineCore`` (scheduler, executor, worker) are unchanged; only the transport between them is a method
call instead of ZMQ sockets. The trade: on an idle machine vLLM's two processes use two cores, so one
replica's many small requests (8-token samples) run 15-30 % slower in one process (``bench/rollout.py``);
the batch path and long responses run as fast. A driver that sets ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
gets vLLM's processes back.
"""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.v1.engine.core_client import EngineCoreClient

# EngineCore methods that vLLM's async clients reach as "<name>_async" utility calls
_UTILITIES = ("get_supported_tasks", "pause_scheduler", "resume_scheduler", "is_scheduler_paused", "profile",
              "reset_mm_cache", "reset_prefix_cache", "reset_encoder_cache", "sleep", "release_kv_cache_memory",
              "wake_up", "is_sleeping", "execute_dummy_batch", "set_weight_version", "get_weight_version",
              "add_lora", "remove_lora", "list_loras", "pin_lora", "save_sharded_state", "collective_rpc")


class _Resources:
    """What ``AsyncLLM.errored`` reads of a client: whether its engine died."""

    engine_dead = False


class InprocAsyncClient(EngineCoreClient):
    """``AsyncLLM``'s engine-core client with the ``EngineCore`` in this process.

    Model steps run in the event loop's own thread, one per ``get_output_async`` while the core has requests
    (so generation never hands the GIL back and forth between two busy threads); calls that can take long
    (``collective_rpc``: a weight update receives over the network) run on a helper thread while the loop
    goes on serving. One asyncio lock keeps the core to one caller at a time: no step runs during a call.
    """

    def __init__(self, vllm_config, executor_class, log_stats: bool):
        from vllm.v1.engine.core import EngineCore

        self.resources = _Resources()
        self.engine_ranks_managed = [0]
        self.engine_core = EngineCore(vllm_config, executor_class, log_stats)
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine-core-call")
        self._lock: asyncio.Lock | None = None  # made in the event loop, on first use
        self._work: asyncio.Event | None = None  # set when a request arrives
        self._closed = False

    def _loop_objects(self) -> tuple[asyncio.Lock, asyncio.Event]:
        if self._lock is None:
            self._lock, self._work = asyncio.Lock(), asyncio.Event()
        if self._closed or self.resources.engine_dead:
            raise RuntimeError("the in-process vLLM engine core is " + ("shut down" if self._closed else "dead"))
        return self._lock, self._work

    # ------------------------------------------------------------------ what AsyncLLM calls
    async def get_output_async(self):
        """The next step's outputs: steps the core while it has requests, waits while it has none."""
        lock, work = self._loop_objects()
        core = self.engine_core
        while True:
            # first let the loop run what is ready (requests arriving, aborts), as vLLM's busy loop takes its
            # input queue before each step: a step then batches every request that has arrived
            await asyncio.sleep(0)
            async with lock:
                busy = core.scheduler.has_requests()
                if busy:
                    try:
                        outputs, model_executed = core.step_fn()
                        core.post_step(model_executed=model_executed)
                    except BaseException:
                        self.resources.engine_dead = True
                        raise
                    if outputs and 0 in outputs:
                        return outputs[0]
            if not busy:
                work.clear()
                await work.wait()

    async def add_request_async(self, request) -> None:
        lock, work = self._loop_objects()
        async with lock:
            self.engine_core.add_request(*self.engine_core.preprocess_add_request(request))
        work.set()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            lock, work = self._loop_objects()
            async with lock:
                self.engine_core.abort_requests(list(request_ids))
            work.set()  # a step removes the aborted requests from the batch

    async def call_utility_async(self, method: str, *args, **kwargs) -> Any:
        """``EngineCore.<method>`` on the helper thread, between two steps."""
        lock, work = self._loop_objects()
        function = getattr(self.engine_core, method)
        async with lock:
            result = await asyncio.get_running_loop().run_in_executor(self._helper, lambda: function(*args, **kwargs))
        work.set()  # e.g. a resumed scheduler has requests again
        return result

    async def compute_weight_checksums_async(self) -> list[dict[str, str]]:
        return await self.call_utility_async("compute_weight_checksums")

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut the core down (its executor and workers). vLLM's ``timeout`` is the grace its core *process*
        gets after SIGTERM; here nothing runs beside the caller but a call on the helper thread, awaited."""
        if self._closed:
            return
        self._closed = True
        self._helper.shutdown(wait=True)
        self.engine_core.shutdown()


def _utility(name: str):
    async def call(self, *args, **kwargs):
        return await self.call_utility_async(name, *args, **kwargs)

    call.__name__ = f"{name}_async"
    call.__doc__ = f"``EngineCore.{name}``, between two steps (``call_utility_async``)."
    return call


for _name in _UTILITIES:
    setattr(InprocAsyncClient, f"{_name}_async", _utility(_name))


@contextlib.contextmanager
def engine_core_in_process():
    """While open, the ``AsyncLLM`` built in this thread gets an ``InprocAsyncClient`` for its engine core."""
    from vllm.v1.engine import async_llm

    original = async_llm.EngineCoreClient

    class _InprocFactory(original):
        @staticmethod
        def make_async_mp_client(vllm_config, executor_class, log_stats, **_):
            return InprocAsyncClient(vllm_config, executor_class, log_stats)

    async_llm.EngineCoreClient = _InprocFactory
    try:
        yield
    finally:
        async_llm.EngineCoreClient = original
