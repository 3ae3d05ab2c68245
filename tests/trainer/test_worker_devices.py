"""Where a trainer rank's tensors live: the batch on the models' device, the results on the host (the driver
has no GPU), and host tensors sent through a collective on the device its backend reduces on (NCCL: the
GPU). On this machine every device is the CPU, so the GPU placement is checked through ``platform.device``
and the backend name, the values through gloo."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megarl.engine import RLBatch


def test_a_rank_runs_its_shard_on_the_platform_device_and_returns_host_tensors(monkeypatch):
    from megarl import platform
    from megarl.trainer import megatron_worker
    from megarl.trainer.megatron_worker import MegatronWorker

    ids = torch.arange(12).view(4, 3) + 1
    batch = RLBatch(ids, torch.ones_like(ids), torch.ones(4, 1, dtype=torch.long))
    moved = []
    monkeypatch.setattr(platform, "device", lambda: "the GPU")
    monkeypatch.setattr(RLBatch, "to", lambda self, device: moved.append(device) or self)
    shard = MegatronWorker._shard(SimpleNamespace(dp_rank=1, dp_size=2), batch)
    assert moved == ["the GPU"] and torch.equal(shard.input_ids, ids[2:])
    values = torch.ones(2, 3)
    assert megatron_worker._to_host((values, None))[1] is None
    assert megatron_worker._to_host(values).device.type == "cpu"


def test_a_collective_reduces_on_the_gpu_under_nccl_and_on_the_host_under_gloo(monkeypatch):
    from megarl.platform import distributed, hardware

    monkeypatch.setattr(hardware, "device", lambda: torch.device("cuda", 3))
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "nccl")
    assert distributed.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "gloo")
    assert distributed.collective_device() == torch.device("cpu")


def test_the_sync_reads_the_actor_under_the_layer_spec_it_was_built_with(monkeypatch):
    """On a GPU with Transformer Engine the engine builds TE's layer spec, whose parameter names differ from the
    local spec's (the norms fused into the linears): the weight sync's export must name them the same way."""
    import megarl.models
    from megarl.trainer import megatron_worker
    from megarl.trainer.megatron_worker import MegatronWorker

    asked = {}

    def export_hf_pieces(chunks, hf_path, layout, **kwargs):
        asked.update(kwargs, hf_path=hf_path)
        return iter(())

    monkeypatch.setattr(megarl.models, "default_transformer_impl", lambda: "transformer_engine")
    monkeypatch.setattr(megarl.models, "export_hf_pieces", export_hf_pieces)
    monkeypatch.setattr(megatron_worker, "unwrap", lambda model: model)
    worker = SimpleNamespace(actor=SimpleNamespace(model=["chunk"]), layout="layout",
                             settings=SimpleNamespace(actor_role=SimpleNamespace(hf_path="/ckpt")))
    assert MegatronWorker._local_shards(worker) == {}
    assert asked == {"replicas": True, "transformer_impl": "transformer_engine", "hf_path": "/ckpt"}
