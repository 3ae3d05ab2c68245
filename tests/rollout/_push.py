"""Put given HF tensors into a fleet through the real weight sync, from a one-rank sender.

The fleet has no test-only way in: a test that wants the engines to serve other weights runs the
production protocol (plan, gloo transport, the replicas' ``ReceiverEndpoint``) with a sender that
holds whole HF tensors instead of Megatron shards:

    pusher = WeightPusher(fleet, model_dir)
    pusher.push(named_tensors)        # every replica serves them; returns the sync's metrics
    pusher.close()
"""
from __future__ import annotations

from typing import Mapping

import torch

from megarl.cluster.worker_group import DistributedWorker


class TensorSource(DistributedWorker):
    """A sender rank that holds whole HF tensors (sync rank 0)."""

    def setup(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from megarl.weight_sync.endpoints import SenderEndpoint

        self.tensors = {name: t.contiguous() for name, t in tensors.items()}
        self.sync = SenderEndpoint(self.rank, self._shards)

    def _shards(self):
        return {name: [(tuple((0, n) for n in t.shape), t)] for name, t in self.tensors.items()}

    def set_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self.tensors) - set(tensors))
        if missing:
            raise ValueError(f"push needs every tensor of the plan; missing {missing[:4]}")
        for name in self.tensors:
            if tuple(tensors[name].shape) != tuple(self.tensors[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, the model has "
                                 f"{tuple(self.tensors[name].shape)}")
            self.tensors[name] = tensors[name].to(self.tensors[name].dtype).contiguous()

    def sync_sources(self) -> dict:
        return self.sync.sources()

    def sync_address(self) -> tuple[str, int]:
        return self.address_and_port()

    def sync_connect(self, plan, world_size, master_addr, master_port, transport, timeout_s) -> None:
        self.sync.connect(plan, world_size, master_addr, master_port, transport, timeout_s)

    def sync_send(self, version: int) -> dict:
        return self.sync.send(version)

    def sync_close(self, dead_ranks: int = 0) -> None:
        self.sync.close(dead_ranks)


class WeightPusher:
    def __init__(self, fleet, model_dir, tensors: Mapping[str, torch.Tensor] | None = None):
        from megarl.models import hf_tensor_shapes
        from megarl.cluster.worker_group import WorkerGroup
        from megarl.weight_sync.session import WeightSyncSession

        shapes = hf_tensor_shapes(str(model_dir))
        initial = {name: torch.zeros(shape) for name, shape in shapes.items()} if tensors is None else \
            {name: tensors[name] for name in shapes}
        self.names = list(shapes)
        self.workers = WorkerGroup(TensorSource, 1, init_args=(initial,), num_cpus_per_worker=0, name="pusher")
        self.session = WeightSyncSession(self.workers, fleet, str(model_dir), bucket_mb=4, timeout_s=120)

    def push(self, tensors: Mapping[str, torch.Tensor], in_flight: str = "wait") -> dict[str, float]:
        """Every replica serves ``tensors`` (HF names; names the model does not have are ignored)."""
        self.workers.call("set_tensors", {name: tensors[name] for name in self.names if name in tensors})
        return self.session.sync(in_flight=in_flight)

    def close(self) -> None:
        self.session.close()
        self.workers.shutdown()


def generate_across_a_sync(fleet, pusher: WeightPusher, old_state: dict, new_state: dict, prompts: list,
                           prompt_of, requests: int, grouped: bool, params, attempts: int = 6):
    """Start ``requests`` generations (``grouped``: groups of 3 samples of one prompt) on replica 0 and, 50 ms
    in, a sync with ``in_flight="abort"``, alternating the new and the old weights, until some request was
    cut mid-way (``attempts`` tries). Returns the generations (request ``i`` is of ``prompts[prompt_of(i)]``),
    the fleet's version after the sync, and the sync's metrics."""
    import asyncio

    client = fleet.client(0)
    generations, metrics = [], {}
    for attempt in range(attempts):
        async def run():
            if grouped:  # group j's samples are requests 3j..3j+2, all of prompt_of(3j)
                calls = [client.generate_group(prompts[prompt_of(3 * j)], params, seed=100 * attempt + 3 * j, n=3)
                         for j in range(requests // 3)]
            else:
                calls = [client.generate(prompts[prompt_of(i)], params, seed=100 * attempt + i) for i in range(requests)]
            tasks = [asyncio.ensure_future(c) for c in calls]
            await asyncio.sleep(0.05)
            sync = asyncio.get_running_loop().run_in_executor(None, lambda: pusher.push(
                new_state if attempt % 2 == 0 else old_state, in_flight="abort"))
            done = await asyncio.gather(*tasks)
            return [g for group in done for g in group] if grouped else done, await sync

        generations, metrics = asyncio.run(run())
        if any(len(set(g.versions)) > 1 for g in generations):
            break
    return generations, fleet.version(), metrics
