"""A vision-language policy learns from the images: GRPO on the shapes task, against a control with the images blanked.

Every row asks the same question ("which colour is the shape?"), so the answer is in the pixels only
(``megarl.devtools.visual_task``). A tiny Qwen2.5-VL is first warmed up on the answer *format* (one digit
among 1-3, drawn at random, independent of the image: ``megarl.devtools.vision_warmup``), so both runs
start at chance. The run that sees the images must end near full validation accuracy; the control, the
same rows with nothing drawn, cannot beat guessing (a policy that always names one colour scores about
1/3). Measured: validation 0.35 -> 1.00 by step 40 with images (about 1 step/s on 2 cores).
"""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from megarl.checks import load_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.curve, pytest.mark.usefixtures("joins_ray")]

STEPS = 40


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.devtools.vision_warmup import warmup_on_images
    from megarl.devtools.visual_task import COLOURS, write_shape_parquet

    root = tmp_path_factory.mktemp("vision_learning")
    rows = pq.read_table(write_shape_parquet(root / "warmup.parquet", 256, seed=7)).to_pylist()
    base = make_tiny_model("qwen2_5_vl", "tiny", root / "random", seed=0)
    return warmup_on_images(base, root / "warm", rows, sorted(COLOURS), steps=40)


def final_validation(model, tmp_path, blank: bool) -> list[float]:
    from megarl.devtools.visual_task import write_shape_parquet
    from megarl.run.train import run

    data = tmp_path / ("blank" if blank else "shapes")
    train = write_shape_parquet(data / "train.parquet", 512, seed=0, blank=blank)
    val = write_shape_parquet(data / "test.parquet", 48, seed=1, blank=blank, split="test")
    last = run(load_config("quickstart", [
        f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={tmp_path / 'run'}", "data.max_prompt_length=128", "data.train_batch_size=16",
        "actor_rollout_ref.rollout.n=8", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=20",
        "trainer.save_freq=-1", "actor_rollout_ref.actor.optim.lr=3e-4"]))
    return [h["val/score"] for h in last["_history"] if "val/score" in h]


@pytest.mark.timeout(1200)
def test_grpo_learns_the_colour_from_the_images_and_not_without_them(warm_model, tmp_path):
    seen = final_validation(warm_model, tmp_path / "images", blank=False)
    control = final_validation(warm_model, tmp_path / "control", blank=True)
    assert seen[0] < 0.6 and control[0] < 0.6, (seen, control)  # both start near chance (1/3)
    assert seen[-1] >= 0.8, f"with the images the policy should name the colour: {seen}"
    assert control[-1] <= 0.6 and seen[-1] - control[-1] >= 0.3, (seen, control)
