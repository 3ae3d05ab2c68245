"""The weight check before a sync or a save: which tensors hold inf/NaN, agreed by every rank."""
from __future__ import annotations

import pytest
import torch

from megarl.engine.finite import nonfinite_tensors
from tests.weight_sync._spawn import free_port, run_processes


def tensors(rank: int = 0, bad: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    named = [("embedding.weight", torch.randn(64, 8)), ("decoder.layers.0.norm.weight", torch.ones(8, dtype=torch.bfloat16)),
             ("empty", torch.empty(0)), ("decoder.layers.0.mlp.weight", torch.full((16, 8), 3e38))]  # huge but finite
    for name, (index, value) in (bad or {}).get(rank, {}).items():
        dict(named)[name].view(-1)[index] = value
    return named


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_single_bad_value_names_its_tensor(value):
    assert nonfinite_tensors(tensors()) == (0, [])  # large finite weights do not overflow the check
    bad = {0: {"decoder.layers.0.norm.weight": (3, value), "decoder.layers.0.mlp.weight": (127, value)}}
    assert nonfinite_tensors(tensors(bad=bad)) == (2, ["decoder.layers.0.norm.weight", "decoder.layers.0.mlp.weight"])


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)
    found = nonfinite_tensors(tensors(rank, {1: {"embedding.weight": (100, float("nan"))}}))
    torch.save(found, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_every_rank_learns_of_a_nan_on_another(tmp_path):
    port = free_port()
    codes, _ = run_processes(_rank, [(rank, port, str(tmp_path)) for rank in range(2)], deadline_s=120)
    assert codes == [0, 0]
    assert torch.load(tmp_path / "0.pt") == (1, [])  # rank 0's own weights are fine, but it must refuse too
    assert torch.load(tmp_path / "1.pt") == (1, ["embedding.weight"])

