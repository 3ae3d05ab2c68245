"""The training loop stops a run that has gone numerically bad: skipped optimizer steps, non-finite weights;
and warns when the sync probe says the fleet serves other weights than the trainer's.

The loop runs over a fake trainer (no processes): its steps report the optimizer steps they tried
and skipped, and its workers answer the weight check as the trainer ranks would.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.checks import ConfigError, load_config
from megarl.run.loop import TrainingLoop
from megarl.run.summary import RunSummary
from megarl.trainer.training_safety import STALE_WEIGHTS_REPEAT, SkippedSteps, StaleWeights, TrainingHalted

BASE = ["data.train_files=/d/train.parquet", "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path=/m",
        "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.resume_mode=disable",
        "trainer.val_before_train=False", "actor_rollout_ref.actor.optim.lr=1000.0"]
COORDS = [{"rank": 0, "dp": 0, "tp": 0, "pp": 0}, {"rank": 1, "dp": 0, "tp": 0, "pp": 1}]


def steps(*skipped: int, tried: int = 2, role: str = "actor") -> list[dict]:
    return [{f"{role}/optimizer_steps": float(tried), f"{role}/skipped_steps": float(s)} for s in skipped]


def test_a_run_of_all_skipped_steps_reaches_the_limit_a_partial_skip_breaks_it():
    watch = SkippedSteps(limit=3)
    history = steps(2, 2, 1, 2, 2) + steps(2)
    assert [watch.record(step, m) for step, m in enumerate(history, 1)] == [None, None, None, None, None, "actor"]
    assert watch.streak["actor"] == [4, 5, 6] and watch.summary() == "actor 11 of 12"
    critic = SkippedSteps(limit=2)  # the critic's streak counts on its own; a step without it leaves it as it was
    for step, m in enumerate([{**steps(0)[0], **steps(1, role="critic")[0]}, steps(0)[0],
                              {**steps(2)[0], **steps(1, tried=1, role="critic")[0]}], 1):
        found = critic.record(step, m)
    assert found is None and critic.summary() == "actor 2 of 6, critic 2 of 3"
    assert critic.record(4, steps(1, tried=1, role="critic")[0]) == "critic"
    never = SkippedSteps(limit=0)
    assert all(never.record(step, m) is None for step, m in enumerate(steps(2, 2, 2, 2), 1))


class _Workers:
    def __init__(self, bad: dict | None = None):
        self.bad, self.calls = bad or {}, []

    def call(self, method, *args):
        self.calls.append(method)
        if method == "nonfinite_params":
            roles = args[0]
            return [{role: {"count": len(self.bad.get(role, {})), "first": self.bad.get(role, {}).get(rank)}
                     for role in roles} for rank in range(2)]
        if method == "save_checkpoint":
            raise AssertionError("a checkpoint was written")
        raise AssertionError(f"unexpected call {method}")


class _Trainer:
    def __init__(self, cfg, history: list[dict], workers: _Workers):
        from megarl.settings.trainer import trainer_settings

        self.settings, self.workers, self.coords, self.use_critic = trainer_settings(cfg), workers, COORDS, False
        self.total_steps, self.val_dataset, self.history, self.global_step = len(history), None, [], 0
        self._history = history

    def train_step(self, step):
        return dict(self._history[step - 1])


class _Logger:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step, console=True, progress=None):
        self.logged.append(step)


def fake_checkpoint(root: Path, step: int) -> Path:
    path = root / "actor" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "megarl_checkpoint.json").write_text(json.dumps({"contents": ["model"]}))
    (root / "actor" / "latest").write_text(f"step_{step}")
    return path


def test_the_loop_stops_after_the_limit_naming_the_cause_and_the_last_checkpoint(tmp_path):
    cfg = load_config(None, [*BASE, f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=-1"])
    saved = fake_checkpoint(tmp_path, 1)
    logger, summary = _Logger(), RunSummary(8)
    loop = TrainingLoop(_Trainer(cfg, steps(0, 1, 2, 2, 2, 2, 2, 2), _Workers()), logger, str(tmp_path), summary)
    with pytest.raises(TrainingHalted) as halted:
        loop.run()
    assert logger.logged == [1, 2, 3, 4, 5]  # the metrics of the steps that diverged are logged first
    message = str(halted.value)
    assert message.startswith("training stopped at step 5: the actor's optimizer skipped every step of 3 training steps "
                              "in a row (steps 3-5; trainer.max_consecutive_skipped_steps=3) because its gradients are "
                              "not finite (inf/NaN), 7 of 10 optimizer steps since the start. Look at the learning rate "
                              "(actor_rollout_ref.actor.optim.lr=1000.0)"), message
    assert f"Last checkpoint: step 1 at {saved};" in message
    assert "  optimizer steps skipped (non-finite gradients): actor 7 of 10" in summary.lines({})


def test_non_finite_weights_are_neither_saved_nor_synced(tmp_path):
    cfg = load_config(None, [*BASE, f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=1"])
    workers = _Workers(bad={"actor": {1: "decoder.layers.3.mlp.linear_fc1.weight"}})
    loop = TrainingLoop(_Trainer(cfg, steps(0), workers), _Logger(), str(tmp_path))
    with pytest.raises(TrainingHalted) as halted:
        loop.run()  # the step-1 save is refused before anything is written
    assert workers.calls == ["nonfinite_params"] and not (tmp_path / "actor").exists()
    assert str(halted.value).startswith(
        "refusing to save the step-1 checkpoint: the actor's weights hold non-finite values (inf/NaN), first in "
        "decoder.layers.3.mlp.linear_fc1.weight (trainer rank 1: pipeline stage 1, tensor rank 0), 1 tensor(s) in all; "
        "nothing was synced or saved."), halted.value
    assert str(halted.value).endswith("The run has no checkpoint yet.")
    with pytest.raises(TrainingHalted, match="refusing to sync the weights of /ck/step_2 to the rollout fleet: "
                                             "the actor's weights hold non-finite values .*embedding.word_embeddings"):
        _sync_after_load(cfg, tmp_path)


def _sync_after_load(cfg, tmp_path):
    """Resume: the loaded checkpoint's weights are checked before the fleet gets them."""
    from megarl.trainer.rollout_memory import RolloutMemory

    class Loading(_Workers):
        def call(self, method, *args):
            return [None, None] if method == "load_checkpoint" else super().call(method, *args)

    trainer = _Trainer(cfg, [], Loading(bad={"actor": {0: "embedding.word_embeddings.weight"}}))
    trainer.rollout_memory, trainer.load_state_dict = RolloutMemory(None, False), lambda state: None
    trainer.weight_sync = None  # never reached
    TrainingLoop(trainer, _Logger(), str(tmp_path))._sync_fleet([(Path("/ck/step_2"), None)], source="the checkpoint")


def test_the_limit_is_a_checked_key():
    assert load_config(None, BASE).trainer.max_consecutive_skipped_steps == 3
    with pytest.raises(ConfigError, match="trainer.max_consecutive_skipped_steps=-1: use 0"):
        load_config(None, [*BASE, "trainer.max_consecutive_skipped_steps=-1"])


def probes(*diffs: float) -> list[dict]:
    return [{"rollout/logprob_diff": d, "rollout/logprob_diff_max": 10 * d} for d in diffs]


def test_stale_weights_warn_at_the_first_step_over_the_threshold_and_then_every_nth():
    from megarl.settings.trainer import trainer_settings

    settings = trainer_settings(load_config(None, BASE))
    watch = StaleWeights.for_run(settings, dtype="torch.float32")  # replicas report torch's names
    assert (watch.threshold, watch.off) == (1e-3, None)
    history = probes(1e-6, 0.8, 2e-6, *[0.5] * (STALE_WEIGHTS_REPEAT + 1))
    said = {step: text for step, m in enumerate(history, 1) if (text := watch.record(step, m)) is not None}
    assert list(said) == [2, 2 + 1 + STALE_WEIGHTS_REPEAT]  # the 1st and the 11th step over it
    assert said[2].startswith("step 2: rollout/logprob_diff=0.8 (max 8) is above 0.001 (the default for float32): the "
                              "rollout fleet's log-probs of the sampled tokens differ from the trainer's, so it may be "
                              "serving stale or partly loaded weights. Check the weight sync's lines"), said[2]
    assert "docs/troubleshooting.md (Weight sync mismatch)" in said[2]
    assert f"{STALE_WEIGHTS_REPEAT + 1} steps over it so far; said again every {STALE_WEIGHTS_REPEAT}" in said[13]
    assert watch.record(20, {}) is None  # a step without the probe (the update measured nothing) says nothing


def test_stale_weights_threshold_by_dtype_by_key_and_off_where_the_gap_is_not_noise():
    from megarl.settings.trainer import trainer_settings

    def watch(*overrides, rollout=None, dtype="bfloat16"):
        return StaleWeights.for_run(trainer_settings(load_config(None, [*BASE, *overrides])), rollout, dtype)

    bf16 = watch()
    assert bf16.threshold == 0.1 and bf16.record(1, probes(0.05)[0]) is None  # bf16 kernels' noise
    assert "above 0.1 (the default for bfloat16)" in bf16.record(2, probes(0.9)[0])
    assert watch(dtype=None).threshold == 0.1  # a fleet that did not say: the looser default
    chosen = watch("trainer.stale_weights_warn_threshold=0.01")
    assert "above 0.01 (trainer.stale_weights_warn_threshold=0.01)" in chosen.record(1, probes(0.05)[0])
    cfg = load_config(None, BASE)
    truncated = watch(rollout=cfg.actor_rollout_ref.rollout.copy())
    assert truncated.off is None
    cfg.actor_rollout_ref.rollout.top_p = 0.9
    for off in (watch("trainer.stale_weights_warn_threshold=0"), watch("actor_rollout_ref.rollout.weight_sync.verify=False"),
                watch(rollout=cfg.actor_rollout_ref.rollout)):
        assert off.off and off.record(1, probes(5.0)[0]) is None, off
    with pytest.raises(ConfigError, match="trainer.stale_weights_warn_threshold=-1.0: use null"):
        load_config(None, [*BASE, "trainer.stale_weights_warn_threshold=-1"])


def test_the_loop_says_the_stale_weight_warning_on_the_console(tmp_path, caplog):
    cfg = load_config(None, [*BASE, f"trainer.default_local_dir={tmp_path}", "trainer.save_freq=-1"])
    history = [{**s, **p} for s, p in zip(steps(0, 0, 0), probes(1e-6, 0.7, 0.7))]
    with caplog.at_level("WARNING", logger="megarl.run.loop"):
        TrainingLoop(_Trainer(cfg, history, _Workers()), _Logger(), str(tmp_path)).run()
    warned = [r.getMessage() for r in caplog.records if r.name == "megarl.run.loop" and r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith("step 2: rollout/logprob_diff=0.7 (max 7) is above 0.1 "
                                                     "(the default for an unknown dtype)"), warned
