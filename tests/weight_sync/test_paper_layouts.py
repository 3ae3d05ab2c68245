"""Paper layouts planned without processes: the bytes planned equal the bytes the destinations need."""
from __future__ import annotations

import math


from pathlib import Path

from megarl.checks import load_config
from megarl.models import ParallelLayout, hf_tensor_shapes
from megarl.settings.engine import layout_from_config
from megarl.weight_sync.layouts import plan_for_layouts
from megarl.weight_sync.rollout_layout import RolloutLayout
from tests.models.test_shards import deepseek_v3, llama3_70b

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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


def test_deepseek_v3_config_plans_its_sync():
    """configs/grpo_moe_671b.yaml (verl's PP16 x EP16, 61 layers as 4 + 14 x 4 + 1) on the real DeepSeek-V3
    config into one of its TP=32 replicas, shard mode (the other 7 get the same bytes by broadcast)."""
    cfg = load_config(str(CONFIGS / "grpo_moe_671b.yaml"), [])
    layout = layout_from_config(cfg.actor_rollout_ref.actor.megatron)
    assert (layout.pp, layout.ep, layout.tp, layout.first_stage_layers, layout.last_stage_layers) == (16, 16, 1, 4, 1)
    world, tp = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    config = deepseek_v3()
    plan = plan_for_layouts(config, layout, world, RolloutLayout(1, tp, "shard", first_rank=world))
    model_bytes = sum(math.prod(s) * (4 if n.endswith("e_score_correction_bias") else 2)
                      for n, s in hf_tensor_shapes(config).items())
    assert plan.bytes_sent == model_bytes  # each byte leaves one source; the fp32 router biases included
    assert plan.bytes_delivered == plan.bytes_needed()
    senders = plan.bytes_by_source()
    assert len(senders) == 256  # every PP stage and EP group sends its own experts in parallel
