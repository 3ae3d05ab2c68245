"""Memory and training knobs on 2 ranks (torchrun, gloo); run by tests/engine/test_engine_memory.py.

    torchrun --nproc-per-node 2 _memory_worker.py memory WORK_DIR

One launch measures everything the test asserts on: the collectives' timeouts, uneven pipeline
stages (PP=2, 1 + 3 layers) against PP=1, a checkpoint saved under them (model and HF export
only) loaded at PP=1, activation recomputation (memory and results), and the offload round trip
of weights, grads and distributed-optimizer state, with a checkpoint written while offloaded.
Results go to ``WORK_DIR/memory.pt`` (rank 0).
"""
from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
import _engine_worker as _engine  # noqa: E402

from megarl.engine import (MegatronActor, checkpoint_contents, data_parallel_shard, load_checkpoint,  # noqa: E402
                           save_checkpoint)
from megarl.engine.offload import Residency, model_offload_groups  # noqa: E402
from megarl.models import ParallelLayout, build_model, save_hf_checkpoint  # noqa: E402
from megarl.platform import destroy_model_parallel  # noqa: E402

WORLD_TIMEOUT_S, MODEL_PARALLEL_TIMEOUT_S = 4321, 1234
UNEVEN = ParallelLayout(pp=2, first_stage_layers=1)  # 4 layers: stage 0 holds 1, stage 1 holds 3
EVEN = ParallelLayout()  # 2 ranks: data parallel


def setup(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    from megarl.platform import initialize_model_parallel

    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel(tp=layout.tp, pp=layout.pp, seed=7, timeout_s=MODEL_PARALLEL_TIMEOUT_S)


def group_timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def timeouts() -> dict:
    from megatron.core import parallel_state as ps

    setup(EVEN)
    return {"world": group_timeout(dist.group.WORLD), "data_parallel": group_timeout(ps.get_data_parallel_group()),
            "tensor_parallel": group_timeout(ps.get_tensor_model_parallel_group()),
            "pipeline": group_timeout(ps.get_pipeline_model_parallel_group())}


# ------------------------------------------------------------------ uneven pipeline stages
def uneven(work: Path, data: dict) -> dict:
    model, batch = _data.DENSE_SMALL, data["batches"][_data.DENSE_SMALL]
    setup(EVEN)
    even = _engine.train_once(work, model, EVEN, _data.actor_settings(), batch)
    setup(UNEVEN)
    actor = _engine.actor_for(work, model, UNEVEN, _data.actor_settings())
    from megatron.core.transformer.transformer_block import TransformerBlock

    blocks = [m for chunk in actor.model for m in chunk.modules() if isinstance(m, TransformerBlock)]
    layers_here = [len(b.layers) for b in blocks]
    log_probs, entropy = actor.compute_log_prob(batch, with_entropy=True)
    metrics = actor.update_policy(batch)
    result = {"even": even, "layers_on_stage": layers_here, "log_probs": log_probs, "entropy": entropy,
              "metrics": metrics, "weights": _engine.weights(actor.model, work / model, UNEVEN)}

    # saved with the model only, plus the HF export; loaded at PP=1 (data parallel)
    root = work / "uneven_checkpoints"
    export = {"hf_model": lambda staging: save_hf_checkpoint([getattr(m, "module", m) for m in actor.model],
                                                              work / model, UNEVEN, staging / "huggingface")}
    path = save_checkpoint(root, 1, actor.model, rng=False, exports=export)
    result["contents"] = checkpoint_contents(path)
    result["hf_export"] = sorted(p.name for p in (path / "huggingface").iterdir())
    setup(EVEN)
    fresh = MegatronActor(build_model(work / model, EVEN, "actor", load_weights=False), _data.actor_settings())
    try:
        load_checkpoint(path, fresh.model, fresh.optimizer)
        result["missing_optimizer_error"] = None
    except ValueError as exc:
        result["missing_optimizer_error"] = str(exc)
    load_checkpoint(path, fresh.model, load_rng=False)
    result["loaded_weights"] = _engine.weights(fresh.model, work / model, EVEN)
    local = data_parallel_shard(batch, *_engine.dp_coords())
    result["loaded_log_probs"] = _engine.gather_dp(fresh.compute_log_prob(local)[0])
    return result


# ------------------------------------------------------------------ recompute
class SavedActivations:
    """Bytes of tensors autograd holds for backward (saved-tensor hooks), live and at their peak.

    A tensor is counted once per storage while any saved reference to it is alive (a storage
    saved twice counts once); the model's parameters are not activations and are skipped.
    """

    def __init__(self, params):
        self.params = {p.untyped_storage()._cdata for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.params:
            return tensor
        box = _Box(tensor)
        if self.refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        weakref.finalize(box, self._release, key, storage.nbytes())
        return box

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= nbytes

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Box) else packed


class _Box:
    def __init__(self, tensor):
        self.tensor = tensor


RECOMPUTE = {
    "none": {},
    "full_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp", "layernorm"]},
}


def recompute(work: Path, data: dict) -> dict:
    model, batch = _data.DENSE_SMALL, data["batches"][_data.DENSE_SMALL]
    setup(EVEN)
    local = data_parallel_shard(batch, *_engine.dp_coords())
    results = {}
    for name, overrides in RECOMPUTE.items():
        actor = MegatronActor(build_model(work / model, EVEN, "actor", config_overrides=overrides),
                              _data.actor_settings(micro_batch_size=4))
        counter = SavedActivations(p for chunk in actor.model for p in chunk.parameters())
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            metrics = actor.update_policy(local)
        results[name] = {"peak_activation_bytes": counter.peak, "metrics": metrics,
                         "weights": _engine.weights(actor.model, work / model, EVEN)}
    return results


# ------------------------------------------------------------------ offload
def snapshot(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def offload(work: Path, data: dict) -> dict:
    """Two identical actors take step 1; one goes through an offload/reload round trip (and writes
    a checkpoint while offloaded); both take step 2; a third actor loads that checkpoint."""
    model, first, second = _data.DENSE, data["batches"][_data.DENSE], data["batch_b"]
    setup(EVEN)
    dp = _engine.dp_coords()
    actors = [_engine.actor_for(work, model, EVEN, _data.actor_settings()) for _ in range(2)]
    for actor in actors:
        actor.update_policy(data_parallel_shard(first, *dp))
    moved, twin = actors
    groups = model_offload_groups(moved.model, moved.optimizer)
    params = [p for chunk in moved.model for p in chunk.parameters()]
    inner = moved.optimizer.chained_optimizers[0].optimizer if hasattr(moved.optimizer, "chained_optimizers") \
        else moved.optimizer.optimizer
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    grad_buffers = [b.grad_data for chunk in moved.model for b in chunk.buffers]
    param_storages = {p.untyped_storage()._cdata: p.untyped_storage() for p in params}
    state_storages = [t.untyped_storage() for t in state]
    before = {"params": snapshot(params), "state": snapshot(state), "ptrs": [p.data_ptr() for p in params]}
    residency = Residency(groups)
    residency.need(["params"], "test: weights only")
    partial = {"resident": residency.resident(), "state_bytes": sum(s.nbytes() for s in state_storages),
               "param_bytes": sum(s.nbytes() for s in param_storages.values())}
    residency.need([], "test: everything out")
    out = {
        "resident": residency.resident(),
        "param_storage_bytes": sum(s.nbytes() for s in param_storages.values()),
        "state_storage_bytes": sum(s.nbytes() for s in state_storages),
        "grad_storage_bytes": sum(g.untyped_storage().nbytes() for g in grad_buffers),
        "params_moved": all(p.data_ptr() != ptr for p, ptr in zip(params, before["ptrs"])),
        "readable_while_offloaded": all(torch.equal(p, q) for p, q in zip(params, before["params"]))
                                    and all(torch.equal(s, q) for s, q in zip(state, before["state"])),
    }
    root = work / "offloaded_checkpoints"
    save_checkpoint(root, 1, moved.model, moved.optimizer, moved.scheduler, extra={"step": 1})
    residency.need(["params", "grads", "optimizer"], "test: back")
    back = {
        "resident": residency.resident(),
        "same_storages": all(p.untyped_storage()._cdata in param_storages for p in params),
        "params_exact": all(torch.equal(p, q) for p, q in zip(params, before["params"])),
        "state_exact": all(torch.equal(s, q) for s, q in zip(state, before["state"])),
        "grads_zero": all(int(g.count_nonzero()) == 0 for g in grad_buffers),
        "grad_storage_bytes": sum(g.untyped_storage().nbytes() for g in grad_buffers),
    }
    steps = {}
    for name, actor in (("round_trip", moved), ("twin", twin)):
        metrics = actor.update_policy(data_parallel_shard(second, *dp))
        steps[name] = {"metrics": metrics, "weights": _engine.weights(actor.model, work / model, EVEN)}
    loaded = _engine.actor_for(work, model, EVEN, _data.actor_settings())
    extra = load_checkpoint(root, loaded.model, loaded.optimizer, loaded.scheduler)
    metrics = loaded.update_policy(data_parallel_shard(second, *dp))
    steps["loaded"] = {"metrics": metrics, "weights": _engine.weights(loaded.model, work / model, EVEN), "extra": extra}
    return {"partial": partial, "out": out, "back": back, "steps": steps}


def memory(work: Path, data: dict) -> dict:
    return {"timeouts": timeouts(), "uneven": uneven(work, data), "recompute": recompute(work, data),
            "offload": offload(work, data)}


if __name__ == "__main__":
    _engine.run_worker_mode({"memory": memory}, timeout_s=WORLD_TIMEOUT_S)
