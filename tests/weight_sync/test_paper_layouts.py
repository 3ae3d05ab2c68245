"""Paper layouts planned without processes: the bytes planned equal the bytes the destinations need."""
from __future__ import annotations

import math

import pytest

from megarl.models import ParallelLayout, hf_tensor_shapes
from megarl.weight_sync.layouts import plan_for_layouts
from megarl.weight_sync.rollout_layout import RolloutLayout
from tests.models.test_shards import deepseek_v3, llama3_70b


def test_llama_70b_tp8_pp4_to_four_tp8_replicas():
    config = llama3_70b()
    plan = plan_for_layouts(config, ParallelLayout(tp=8, pp=4), 32, RolloutLayout(4, 8, "shard", first_rank=32))
    plan.check()  # every needed element reaches every rank that needs it, exactly once
    model_bytes = 2 * sum(math.prod(s) for s in hf_tensor_shapes(config).values())
    assert plan.bytes_sent == model_bytes  # each byte leaves exactly one source ...
    assert plan.bytes_delivered == plan.bytes_needed()  # ... and fans out to the 4 replicas by broadcast
    by_source = plan.bytes_by_source()
    assert len(by_source) == 32  # every TP rank of every PP stage sends
    assert max(by_source.values()) / min(by_source.values()) < 1.5
    assert max(b.nbytes for b in plan.buckets) <= 512 << 20


def test_deepseek_v3_pp16_ep16_to_tp32():
    """verl's 671B layout (PP16 x EP16, 61 layers as 4 + 14 x 4 + 1) into one TP=32 replica, shard mode."""
    config = deepseek_v3()
    layout = ParallelLayout(pp=16, ep=16, first_stage_layers=4, last_stage_layers=1)
    plan = plan_for_layouts(config, layout, 256, RolloutLayout(1, 32, "shard", first_rank=256))
    model_bytes = sum(math.prod(s) * (4 if n.endswith("e_score_correction_bias") else 2)
                      for n, s in hf_tensor_shapes(config).items())
    assert plan.bytes_sent == model_bytes  # each byte leaves one source; the fp32 router biases included
    assert plan.bytes_delivered == plan.bytes_needed()
    senders = plan.bytes_by_source()
    assert len(senders) == 256  # every PP stage and EP group sends its own experts in parallel
