"""GRPO on a vision-language model end to end: tiny Qwen2.5-VL and Qwen3-VL-MoE, verl's multimodal parquet.

Qwen3-VL-MoE is Qwen3-VL's tower, DeepStack and M-RoPE around MoE layers, so its run covers Qwen3-VL's
vision path too (the dense MLP is Qwen2.5-VL's and every text family's); Qwen3-VL's own bridge, export
and sync are tested in tests/models and tests/weight_sync.

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

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]

STEPS = 2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
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


@pytest.mark.timeout(900)
def test_verls_qwen2_5_vl_geo3k_launch_runs_with_only_paths_and_sizes_changed(tmp_path, monkeypatch):
    """verl's ``run_qwen2_5_vl-7b-megatron.sh`` (GRPO on Geometry3K) exactly as verl writes it: its keys (TP2 actor
    and reference, dynamic batch sizes, KL loss, offload flags, vLLM engine kwargs), its data format (geo3k.py's
    parquet, images as PNG bytes) and its built-in reward (``hiyouga/geometry3k``). Only the paths, the sizes
    (batch, lengths, 2 CPU ranks, 2 steps) and the logger (no wandb here) change."""
    import json
    from pathlib import Path

    from megarl.config.command_line import parse_command_line
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.run.train import run
    from tests.data.vision_helpers import geo3k_row, noise_image, write_geo3k

    launch = next(json.loads(line) for line in (Path(__file__).parents[1] / "config" / "verl_launches" /
                                                  "megatron-example-launches.jsonl").read_text().splitlines()
                  if line and json.loads(line)["script"].endswith("run_qwen2_5_vl-7b-megatron"))
    model = make_tiny_model("qwen2_5_vl", "tiny", tmp_path / "model", seed=0)
    files = {}
    for split, count in (("train", 8), ("test", 4)):
        rows = [geo3k_row(f"<image>Find x in the triangle {i}.", str(30 + i), [noise_image(60 + 8 * i, 90, i)], i, split)
                for i in range(count)]
        files[split] = write_geo3k(rows, tmp_path / f"{split}.parquet")
    changed = {"data.train_files": files["train"], "data.val_files": files["test"], "actor_rollout_ref.model.path": model,
               "data.train_batch_size": 4, "data.max_prompt_length": 256, "data.max_response_length": 8,
               "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.rollout.n": 2,
               "trainer.n_gpus_per_node": 2, "trainer.logger": '["console","tensorboard"]'}
    args = []
    for arg in launch["argv"][2:]:
        key = arg.partition("=")[0]
        args.append(f"{key}={changed.pop(key.lstrip('+'))}" if key.lstrip("+") in changed else arg)
    assert not changed, f"the launch no longer sets {sorted(changed)}"
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # verl's relative --config-path=config: megarl's packaged configs
    cmd = parse_command_line([*args, "trainer.total_training_steps=2", f"trainer.default_local_dir={out}",
                              "trainer.plan_check=False"])
    run(load_config(cmd.name, cmd.overrides, config_path=cmd.config_path, preflight=True))
    logged = scalars(out)
    assert [step for step, _ in logged["actor/pg_loss"]] == [1, 2]
    assert all(math.isfinite(v) for _, v in logged["actor/kl_loss"])  # use_kl_loss: the TP2 reference ran on images
    diffs = [v for _, v in logged["rollout/logprob_diff"]]
    assert max(diffs) < 1e-4, diffs  # the TP2 trainer and the engine saw the same pixels, weights and positions
    assert "val-core/hiyouga/geometry3k/reward/mean@1" in logged  # verl's reward, by the data's source
