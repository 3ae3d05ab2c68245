"""The planner on vision-language models (tiny Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE configs; arithmetic only).

Qwen3-VL's language model sits under ``model.language_model.``: its layers must be placed on their own
pipeline stages in the sync's traffic estimate (they once all fell on the last one), which then equals the
sync planner's real buckets; the vision tower is counted on the first stage, whole on every TP rank.
"""
import math

import pytest

from megarl.models import ParallelLayout, load_hf_config
from megarl.plan.model import ModelFacts
from megarl.plan.sync import SyncLayout, sync_traffic, traffic_from_plan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("vl_plan")
    return {family: ModelFacts(load_hf_config(make_tiny_model(family, "tiny", root / family)))
            for family in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_sync_traffic_of_a_vision_language_model_equals_the_sync_planners(tiny, family):
    from megarl.weight_sync.layouts import plan_for_layouts
    from megarl.weight_sync.rollout_layout import RolloutLayout

    model = tiny[family]
    layout = ParallelLayout(tp=2, pp=2)  # one layer per stage; each stage on its own node, the engines on a third
    sync = SyncLayout((0, 1, 2, 3), ((4, 5),), per_node=2)
    ours = sync_traffic(model, layout, sync)
    theirs = traffic_from_plan(plan_for_layouts(model.hf_config, layout, 4, RolloutLayout(1, 2, "shard", first_rank=4)),
                               sync)
    assert (ours.bytes_sent, ours.bytes_delivered) == (theirs.bytes_sent, theirs.bytes_delivered)
    for rank in range(6):
        a, b = ours.per_rank[rank], theirs.per_rank[rank]
        assert a.ib_in + a.nvlink_in == pytest.approx(b.ib_in + b.nvlink_in, rel=1e-9), rank
        assert a.ib_out == pytest.approx(b.ib_out, rel=0.05), rank  # the first stage sends its layer and the tower


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_vision_tower_is_counted_whole_on_each_tp_rank_of_the_first_stage(tiny, family):
    model = tiny[family]
    tower = {n: s for n, s in model.hf_shapes.items() if n.startswith(model.dims.vision.hf_prefix)}
    assert len(tower) > 10 and model.vision_params == sum(math.prod(s) for s in tower.values())
    assert model.active_params == model.hf_params - model.vision_params  # the tower runs on patches, not tokens
    layout = ParallelLayout(tp=2, pp=2)
    first, last = model.stage_params(layout, 0), model.stage_params(layout, 1)
    assert sum(p.numel for p in first.params if p.name.startswith("visual.")) == model.vision_params
    assert not any(p.name.startswith("visual.") for p in last.params)


def test_the_report_names_the_vision_tower(tiny, tmp_path):
    from megarl.checks import load_config
    from megarl.plan import gpu, plan_config
    from megarl.plan.report import as_dict, render

    model = tiny["qwen3_vl"]
    path = tmp_path / "qwen3_vl"
    model.hf_config.save_pretrained(path)
    cfg = load_config(None, ["data.train_files=x.parquet", f"actor_rollout_ref.model.path={path}",
                             "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "algorithm.adv_estimator=grpo",
                             "actor_rollout_ref.rollout.n=2"])
    plan = plan_config(cfg, gpu("H100"))
    assert as_dict(plan)["model"]["vision_parameters"] == model.vision_params > 0
    assert "the vision tower (whole on each TP rank of the first stage)" in render(plan)
