"""GRPO on a vision-language model end to end: tiny Qwen2.5-VL and Qwen3-VL, verl's multimodal parquet.

The data is the synthetic shapes task (``megarl.devtools.visual_task``: the colour of a shape drawn in
each image, written as verl's geo3k parquet). Each run takes 2 steps with vLLM generating from the
images, the trainer computing log-probs and updates on the same pixels, and the weights (vision tower
included) synced back. The sync probe ``rollout/logprob_diff`` compares the engine's log-probs of the
sampled tokens with the trainer's before the first update: near 0 only if the trainer saw the pixels
the engine saw, at the same positions (M-RoPE), with the same weights.
"""
from __future__ import annotations

import math

import pytest

from megarl.checks import load_config
from tests.trainer.test_e2e import VARIED_REWARD, overrides, scalars

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

STEPS = 2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_grpo_on_images_keeps_the_trainer_and_the_fleet_in_step(family, quickstart_inputs, tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.devtools.visual_task import write_shape_parquet
    from megarl.run.train import run

    model = make_tiny_model(family, "tiny", tmp_path / family, seed=0)
    data = {"data": tmp_path / "data"}
    write_shape_parquet(data["data"] / "train.parquet", 16, seed=0)
    write_shape_parquet(data["data"] / "test.parquet", 4, seed=1, split="test")
    reward_file = tmp_path / "varied.py"
    reward_file.write_text(VARIED_REWARD)  # the random model never answers the task; this reward still varies
    out = tmp_path / "run"
    run(load_config("quickstart", overrides(
        {**quickstart_inputs, **data, "model": model}, out, f"custom_reward_function.path={reward_file}",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "data.max_prompt_length=128",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.val_before_train=false")))
    logged = scalars(out)
    losses = [v for _, v in logged["actor/pg_loss"]]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    diffs = [v for _, v in logged["rollout/logprob_diff"]]
    assert len(diffs) == STEPS and max(diffs) < 1e-4, (family, diffs)
