"""The config system: YAML + overrides, typed schema, and validation errors that name key and fix."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.checks import ConfigError, load_config
from megarl.config import schema_keys

REPO = Path(__file__).resolve().parents[2]

# A valid 2-node, 8-GPU layout: actor TP=2 x PP=2 -> DP=4.
BASE = [
    "data.train_files=/data/train.parquet",
    "actor_rollout_ref.model.path=/models/tiny",
    "algorithm.adv_estimator=grpo",
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=8",
    "data.train_batch_size=64",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
]


def load(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    return str(info.value)


def test_base_config_is_valid_and_typed():
    cfg = load()
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6  # verl's default
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    # interpolations resolve to the data section, as in verl
    assert cfg.actor_rollout_ref.rollout.prompt_length == cfg.data.max_prompt_length == 512
    assert cfg.critic.model.path == "/models/tiny"


def test_override_parses_yaml_values_and_types():
    cfg = load("trainer.logger=['console']", "actor_rollout_ref.rollout.temperature=0.7")
    assert list(cfg.trainer.logger) == ["console"]
    assert cfg.actor_rollout_ref.rollout.temperature == pytest.approx(0.7)
    msg = error_of("actor_rollout_ref.rollout.n=many")
    assert "actor_rollout_ref.rollout.n" in msg


def test_every_shipped_yaml_validates():
    required = {"ppo_megatron_trainer": ["data.train_files=/data/train.parquet", "actor_rollout_ref.model.path=/m",
                                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                         "critic.ppo_micro_batch_size_per_gpu=4"]}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path, required.get(path.stem, []))


def test_gpus_not_divisible_by_model_parallel():
    msg = error_of("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3")
    assert "trainer.n_gpus_per_node * trainer.nnodes = 16" in msg and "TP x PP x CP = 3 x 2 x 1 = 6" in msg


def test_context_parallel_counts_in_model_parallel():
    msg = error_of("actor_rollout_ref.actor.megatron.context_parallel_size=3")
    assert "TP x PP x CP = 2 x 2 x 3 = 12" in msg


def test_mini_batch_must_divide_train_batch():
    msg = error_of("actor_rollout_ref.actor.ppo_mini_batch_size=24")
    assert "ppo_mini_batch_size=24 must divide data.train_batch_size=64" in msg


def test_micro_batch_must_split_mini_batch_so_grad_accumulation_is_never_zero():
    # 16 prompts * 4 samples / DP 4 = 16 samples per rank; micro 32 would give 0 accumulation steps
    msg = error_of("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32")
    assert "ppo_micro_batch_size_per_gpu=32 must divide the 16 samples" in msg
    assert "NaN" in msg
    msg = error_of("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert "must divide the 16 samples" in msg


def test_micro_batch_required_unless_dynamic():
    msg = error_of("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null")
    assert "use_dynamic_bsz=True" in msg
    load("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "actor_rollout_ref.actor.use_dynamic_bsz=true")


def test_mini_batch_samples_must_split_over_data_parallel():
    # DP=4; 1 prompt * 2 samples cannot be spread over 4 ranks
    msg = error_of("actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1")
    assert "do not split evenly over the 4 data-parallel ranks" in msg


def test_rollout_tp_must_divide_rollout_gpus():
    msg = error_of("actor_rollout_ref.rollout.tensor_model_parallel_size=3")
    assert "rollout.tensor_model_parallel_size=3 must divide the 16 rollout devices (colocated placement)" in msg
    msg = error_of("trainer.placement=split", "trainer.rollout_gpus=6",
                   "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                   "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert "must divide the 6 rollout devices (split placement)" in msg


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, "actor_rollout_ref.rollout.temprature=0.5"])
    assert "unknown config key 'actor_rollout_ref.rollout.temprature'" in str(info.value)
    assert "Did you mean 'actor_rollout_ref.rollout.temperature'" in str(info.value)


def test_unknown_key_points_to_where_it_lives():
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, "actor_rollout_ref.actor.n=8"])
    assert "exists at 'actor_rollout_ref.rollout.n'" in str(info.value)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  n_gpu_per_node: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, BASE)
    assert str(path) in str(info.value) and "trainer.n_gpus_per_node" in str(info.value)


def test_missing_required_keys_are_named():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.adv_estimator=grpo"])
    assert "data.train_files" in str(info.value) and "actor_rollout_ref.model.path" in str(info.value)


def test_group_estimator_needs_more_than_one_sample():
    msg = error_of("actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    assert "rollout.n >= 2" in msg


def test_several_problems_are_reported_together():
    msg = error_of("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "trainer.save_freq=0")
    assert "tensor_model_parallel_size=3" in msg and "trainer.save_freq=0" in msg


def test_a_save_needs_a_positive_time_bound():
    assert load().trainer.save_timeout_s == 3600
    assert "trainer.save_timeout_s=0.0: must be > 0" in error_of("trainer.save_timeout_s=0")


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["trainer.nnodes"])


def test_schema_keys_use_verl_names():
    keys = set(schema_keys())
    for key in ["data.train_files", "actor_rollout_ref.actor.ppo_mini_batch_size",
                "actor_rollout_ref.rollout.tensor_model_parallel_size", "algorithm.kl_ctrl.kl_coef",
                "critic.cliprange_value", "trainer.n_gpus_per_node", "custom_reward_function.path"]:
        assert key in keys


@pytest.mark.heavy  # starts a process
def test_cli_config_show_prints_resolved_yaml_and_errors(tmp_path):
    from tests.config._fixtures import write_model_config, write_prompts

    model = write_model_config(tmp_path / "model")
    data = write_prompts(tmp_path / "train.parquet", rows=16, data_source="megarl/arithmetic")
    files = [f"data.train_files={data}", f"data.val_files={data}", f"actor_rollout_ref.model.path={model}"]
    cmd = [sys.executable, "-m", "megarl.run.cli", "config", "show", "quickstart", "actor_rollout_ref.rollout.n=4", *files]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "'n': 4" in out.stdout and "prompt_length: 48" in out.stdout
    bad = subprocess.run(cmd[:-3] + ["actor_rollout_ref.rollout.nn=4"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    # the same checks as a launch: the unknown key and the quickstart's missing files, in one report
    assert bad.returncode == 2 and "Did you mean 'actor_rollout_ref.rollout.n'" in bad.stderr
    assert "runs/quickstart/model: no such directory" in bad.stderr and "train.parquet' does not exist" in bad.stderr


def test_reference_and_critic_share_the_actor_layout():
    msg = error_of("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4")
    assert "actor_rollout_ref.ref.megatron must use the actor's parallel layout" in msg
    assert "tensor_model_parallel_size: 4 vs 2" in msg
    cfg = load()  # by default both follow the actor's layout, as in verl
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    assert cfg.critic.megatron.pipeline_model_parallel_size == 2
    msg = error_of("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4",
                   "critic.megatron.pipeline_model_parallel_size=1")
    assert "critic.megatron must use the actor's parallel layout" in msg


def test_the_layout_comparison_covers_every_layout_key():
    """The layout rule spells the layout keys out (the reader check reads its source); they must be the schema's."""
    import inspect

    from megarl.checks import rules
    from megarl.config.schema import LAYOUT_KEYS

    source = inspect.getsource(rules._check_layout_and_batches)
    assert all(f'"{key}"' in source for key in LAYOUT_KEYS)


@pytest.mark.parametrize("overrides,expected", [([], None), (["actor_rollout_ref.actor.loss_agg_mode=token-mean"], "token-mean")])
def test_gspo_keeps_its_own_aggregation_unless_one_is_given(overrides, expected):
    """Unset loss_agg_mode: GSPO's policy term aggregates with its own default (seq-mean-token-mean,
    as verl), entropy/KL with token-mean; a given mode applies to every term."""
    import inspect

    from megarl.algorithms import POLICY_LOSSES
    from megarl.settings.engine import actor_settings

    cfg = load_config("quickstart", ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"] + overrides)
    assert actor_settings(cfg, dp_size=1).loss.loss_agg_mode == expected
    assert inspect.signature(POLICY_LOSSES["gspo"]).parameters["loss_agg_mode"].default == "seq-mean-token-mean"


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lr=-1e-6", "actor_rollout_ref.actor.optim.lr=-1e-06: the learning rate must be a "
                                               r"finite number >= 0 \(a negative one ascends the loss\)"),
    ("actor_rollout_ref.actor.optim.lr=nan", "actor_rollout_ref.actor.optim.lr=nan: the learning rate must be"),
    ("actor_rollout_ref.actor.optim.min_lr=1e-3", r"actor_rollout_ref.actor.optim.min_lr=0.001: the schedule's floor "
                                                  r"must lie in \[0, lr=1e-06\]"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=2", r"min_lr_ratio=2.0 gives min_lr=2e-06: the schedule's floor"),
    ("actor_rollout_ref.actor.optim.lr_warmup_init=1e-3", r"lr_warmup_init=0.001: the warmup starts in \[0, lr=1e-06\]"),
    ("actor_rollout_ref.actor.optim.eps=-1", "actor_rollout_ref.actor.optim.eps=-1.0: must be >= 0"),
    ("actor_rollout_ref.actor.optim.weight_decay=-0.1", "optim.weight_decay=-0.1: must be >= 0"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.0]", r"optim.betas=\[0.9, 1.0\]: each must lie in \[0, 1\)"),
    ("critic.optim.lr=-1e-5", "critic.optim.lr=-1e-05: the learning rate must be"),
])
def test_optimizer_values_torch_or_megatron_would_refuse_late_fail_at_load(override, message):
    """Values that torch's Adam or megatron's LR scheduler refuse only once the trainer ranks build their
    optimizer (after Ray and the engines started) are config errors naming the key."""
    critic = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4"] if override.startswith("critic") else []
    assert re.search(message, error_of(*critic, override))


def test_a_zero_learning_rate_is_allowed_with_a_note():
    notes: list[str] = []
    load_config(None, [*BASE, "actor_rollout_ref.actor.optim.lr=0"], notes=notes)
    assert "actor_rollout_ref.actor.optim.lr=0: that role's weights never change" in notes
