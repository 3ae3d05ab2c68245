"""The checks of a vision-language run before anything starts: what megarl does not do with images yet is
refused by name, and freeze_vision_tower is honoured only where there is a tower."""
from __future__ import annotations

import pytest

from megarl.devtools.tiny_model import make_tiny_model
from megarl.devtools.visual_task import write_shape_parquet
from tests.config._fixtures import write_model_config
from tests.config.test_preflight import check


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_config")
    return (make_tiny_model("qwen2_5_vl", "tiny", root / "vl"), write_shape_parquet(root / "shapes.parquet", 8),
            write_model_config(root / "text"))


def test_a_vision_language_run_passes_and_freezes_its_tower(inputs):
    vl, data, _ = inputs
    base = [f"actor_rollout_ref.model.path={vl}", f"data.train_files={data}", "data.max_prompt_length=128"]
    assert check(*base) == []
    assert check(*base, "actor_rollout_ref.actor.freeze_vision_tower=True") == []


def test_what_does_not_read_images_yet_is_refused_by_name(inputs):
    vl, data, _ = inputs
    base = [f"actor_rollout_ref.model.path={vl}", f"data.train_files={data}", "data.max_prompt_length=128"]
    (cp,) = [p for p in check(*base, "trainer.n_gpus_per_node=2",
                              "actor_rollout_ref.actor.megatron.context_parallel_size=2") if "context" in p]
    assert "context parallelism for vision-language models (M-RoPE positions) is not supported (planned: issue 28)" in cp
    reward = check(*base, "reward_model.enable=True", f"reward_model.model.path={vl}")
    assert any("reward models that read images" in p and "issue 28" in p for p in reward), reward


def test_freezing_a_tower_a_text_model_lacks_is_an_error(inputs):
    _, data, text = inputs
    problems = check(f"actor_rollout_ref.model.path={text}", f"data.train_files={data}", "data.max_prompt_length=128",
                     "actor_rollout_ref.actor.freeze_vision_tower=True")
    assert any("freeze_vision_tower=True" in p and "has no vision tower" in p for p in problems), problems
