"""The merged weight of a bf16 adapted linear: ``W + alpha/r * B A`` computed in fp32 and rounded
to bf16 once, region by region (the export's and the sync's view of an adapted linear)."""
from __future__ import annotations

import types

import torch

from megarl.models.lora.merge import MergedWeight


def bf16_linear(out: int = 64, inp: int = 48, rank: int = 8, scale: float = 2.0, seed: int = 0):
    """What ``MergedWeight`` reads of an adapted linear (weight, A, effective B, scale), in bf16."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out, inp, generator=g) * 0.05).bfloat16()
    a = (torch.randn(rank, inp, generator=g) * 0.05).bfloat16()
    b = (torch.randn(out, rank, generator=g) * 0.01).bfloat16()
    return types.SimpleNamespace(weight=weight, lora_A=a, lora_scale=scale, lora_B_effective=lambda: b)


def test_bf16_merge_rounds_once_in_fp32():
    module = bf16_linear()
    merged = MergedWeight(module).materialize()
    exact = module.weight.float() + module.lora_scale * (module.lora_B_effective().float() @ module.lora_A.float())
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, exact.bfloat16())  # the true merged value, rounded once
    # the naive bf16 merge (B A rounded to bf16, then added in bf16) rounds twice: other values
    naive = module.weight + module.lora_scale * (module.lora_B_effective() @ module.lora_A)
    assert (naive != merged).sum() > 0.05 * merged.numel()


def test_regions_of_the_merged_weight_equal_the_whole():
    module = bf16_linear()
    whole = MergedWeight(module).materialize()
    window = MergedWeight(module).window((slice(8, 40), slice(16, 48)))
    assert window.shape == (32, 32)
    assert torch.equal(window[4:20, 0:10], whole[12:28, 16:26])
    assert torch.equal(window.materialize(), whole[8:40, 16:48])
