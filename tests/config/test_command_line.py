"""verl's command-line forms, key policy and one-pass reporting, through ``load_config`` and the CLIs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megarl.checks import ConfigError, load_config
from megarl.config.command_line import CommandLineError, parse_command_line
from tests.config._fixtures import write_model_config, write_prompts

VALID = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
         "trainer.n_gpus_per_node=2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]


def problems_of(*overrides: str, name=None, config_path=None) -> list:
    with pytest.raises(ConfigError) as info:
        load_config(name, [*VALID, *overrides], config_path=config_path)
    return info.value.problems


def messages(*overrides: str, **kw) -> str:
    return "\n".join(p.message for p in problems_of(*overrides, **kw))


# ------------------------------------------------------------------ config path and name
def test_config_name_with_or_without_yaml_relative_to_config_path_or_cwd(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "grpo_math.yaml").write_text("trainer:\n  project_name: from_conf_dir\n")
    (tmp_path / "here.yaml").write_text("trainer:\n  project_name: from_cwd\n")
    monkeypatch.chdir(tmp_path)
    for name in ("grpo_math", "grpo_math.yaml"):
        assert load_config(name, VALID, config_path="conf").trainer.project_name == "from_conf_dir"
    assert load_config("here", VALID).trainer.project_name == "from_cwd"
    assert load_config(str(tmp_path / "here.yaml"), VALID).trainer.project_name == "from_cwd"
    # megarl's packaged configs by name, and verl's package-relative --config-path=config
    assert load_config("quickstart", VALID).trainer.project_name == "quickstart"
    assert load_config("ppo_megatron_trainer.yaml", VALID, config_path="config").data.filter_overlong_prompts is False
    with pytest.raises(ConfigError, match="config 'nothere' not found in .*packaged configs: .*quickstart"):
        load_config("nothere", VALID)
    with pytest.raises(ConfigError, match="--config-path /no/such/dir: no such directory"):
        load_config("x", VALID, config_path="/no/such/dir")


def test_defaults_list_builds_on_megarls_ppo_megatron_trainer(tmp_path):
    """verl's user configs start from its default: `defaults: [ppo_megatron_trainer, _self_]`,
    with a search path into verl's package (dropped: megarl's configs are always searched)."""
    (tmp_path / "mine.yaml").write_text("hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
                                        "defaults:\n  - ppo_megatron_trainer\n  - _self_\n"
                                        "data:\n  max_prompt_length: 77\n")
    cfg = load_config("mine", VALID, config_path=tmp_path)
    assert cfg.data.max_prompt_length == 77 and cfg.data.filter_overlong_prompts is False  # the default's value


def test_command_line_forms():
    cmd = parse_command_line(["--config-path=config", "--config-name", "ppo_megatron_trainer.yaml", "a.b=1", "~c", "+d=2"])
    assert (cmd.config_path, cmd.config_name, cmd.overrides) == ("config", "ppo_megatron_trainer.yaml", ["a.b=1", "~c", "+d=2"])
    cmd = parse_command_line(["-cp", "conf", "-cn=x", "--cfg", "job", "a=1"])
    assert (cmd.config_path, cmd.config_name, cmd.print_config, cmd.overrides) == ("conf", "x", True, ["a=1"])
    assert parse_command_line(["a=1"]).name == "ppo_megatron_trainer"  # override-only: verl's default config
    assert parse_command_line(["quickstart", "a=1"], leading_name=True).config_name == "quickstart"
    with pytest.raises(CommandLineError, match="multirun"):
        parse_command_line(["-m", "a=1,2"])
    with pytest.raises(CommandLineError, match="unknown option --frobnicate"):
        parse_command_line(["--frobnicate"])


def test_hydra_override_semantics():
    cfg = load_config(None, [*VALID, "trainer.logger=[console,jsonl]", "data.val_files=['/d/a b.parquet', '/d/c.parquet']",
                             "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=5", "~trainer.experiment_name",
                             "actor_rollout_ref.actor.optim.betas=[0.9,0.95]", "trainer.logger=console"])
    assert list(cfg.trainer.logger) == ["console"]  # verl accepts one logger name as a string
    assert list(cfg.data.val_files) == ["/d/a b.parquet", "/d/c.parquet"]
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs == 5
    assert cfg.trainer.experiment_name == "default"  # deleted: back to the schema's default
    assert list(cfg.actor_rollout_ref.actor.optim.betas) == [0.9, 0.95]
    # Hydra's rules: '+' on a key that has a value is an error, '++' adds or sets
    assert "Could not append to config. An item is already at 'trainer.nnodes'" in messages("+trainer.nnodes=2")
    assert load_config(None, [*VALID, "++trainer.nnodes=1"]).trainer.nnodes == 1
    assert "is a sweep" in messages("trainer.nnodes=1,2")
    # verl's own keys need no '+' (verl's defaults have them), nor do new keys inside a free-form dict
    load_config(None, [*VALID, "actor_rollout_ref.actor.use_torch_compile=False",
                       "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=fused"])



@pytest.mark.heavy  # starts a process
def test_a_key_that_follows_another_may_be_set_before_it_on_the_command_line():
    """critic.model.path and reward_model.model.input_tokenizer default to ${actor_rollout_ref.model.path}: setting
    them before the actor's path is set (later on the same line) is not an OmegaConf traceback."""
    rest = [o for o in VALID if not o.startswith("actor_rollout_ref.model.path=")]
    cfg = load_config(None, ["critic.model.path=/critic", "reward_model.model.input_tokenizer=/tok", *rest,
                             "actor_rollout_ref.model.path=/m"])
    assert (cfg.critic.model.path, cfg.reward_model.model.input_tokenizer, cfg.actor_rollout_ref.model.path) == (
        "/critic", "/tok", "/m")
    result = subprocess.run([sys.executable, "-m", "megarl.run.train", "critic.model.path=/critic",
                             "actor_rollout_ref.model.path=/m"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "required config keys are not set: data.train_files" in result.stderr


# ------------------------------------------------------------------ one pass, pointers, refusals
def test_every_problem_is_reported_in_one_pass_one_line_each():
    problems = problems_of("actor_rollout_ref.actor.lr=1e-6", "actor_rollout_ref.actor.max_grad_norm=1.0",
                           "trainer.nnodes=many", "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.type=dora",
                           "actor_rollout_ref.actor.strategy=fsdp2",
                           "actor_rollout_ref.rollout.name=trtllm", "reward_model.reward_manager=prime",
                           "trainer.save_freq=0", "data.reward_fn_key=source")
    text = [p.message for p in problems]
    assert len(text) == 8 and all("\n" not in line for line in text), text
    assert any("unknown config key 'actor_rollout_ref.actor.lr'. megarl's key for it is 'actor_rollout_ref.actor.optim.lr'" in t for t in text)
    assert any("'actor_rollout_ref.actor.max_grad_norm'. megarl's key for it is 'actor_rollout_ref.actor.grad_clip'" in t for t in text)
    assert any(t.startswith("trainer.nnodes='many'") for t in text)
    assert any("trainer.save_freq=0" in t for t in text)
    refusals = {p.feature: p for p in problems if p.is_refusal}
    assert "use lora.type=lora" in refusals["DoRA (weight-decomposed adapters)"].message
    assert "set strategy=megatron" in refusals["the FSDP training backend"].message
    assert "megarl runs vLLM (rollout.name=vllm)" in refusals["TensorRT-LLM as the rollout engine"].message
    assert "megarl's reward managers are naive, dapo, batch" in refusals["verl's 'prime' reward manager"].message


@pytest.mark.parametrize("override, feature, issue", [
    ("actor_rollout_ref.rollout.name=sglang", "SGLang as the rollout engine", None),
    ("actor_rollout_ref.actor.strategy=fsdp", "the FSDP training backend", None),
    ("+reward_model.use_reward_loop=False", "verl's legacy reward-model worker (a training-engine forward)", None),
    ("+reward.reward_model.rollout.load_format=dummy", "vLLM load formats other than auto", None),
    ("actor_rollout_ref.model.lora.dtype=bf16", "an adapter dtype apart from the model's", None),
    ("actor_rollout_ref.rollout.profiler.enable=True", "profiling the rollout or reward-model engines", None),
    ("actor_rollout_ref.model.mtp.enable=True", "multi-token prediction (MTP) layers", 24),
    ("actor_rollout_ref.model.mtp.enable_train=True", "multi-token prediction (MTP) layers", 24),
])
def test_refusals_name_the_feature_what_megarl_does_and_the_issue(override, feature, issue):
    (problem,) = [p for p in problems_of(override, "trainer.n_gpus_per_node=4") if p.is_refusal]
    assert (problem.feature, problem.issue) == (feature, issue)
    assert override.lstrip("+").split("=")[0] in problem.message and "; " in problem.message  # the key as written


def test_context_parallelism_is_honoured_and_needs_packed_sequences_in_every_role():
    """verl's context_parallel_size loads (the reference follows the actor's, as in verl); with it, a role
    that turns packing off is refused naming its key; model.use_remove_padding (FSDP's) is noted."""
    cp2 = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.context_parallel_size=2"]
    notes: list[str] = []
    cfg = load_config(None, [*VALID, *cp2, "actor_rollout_ref.model.use_remove_padding=False"], notes=notes)
    assert cfg.actor_rollout_ref.ref.megatron.context_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.megatron.use_remove_padding is True
    assert any("its Megatron workers, like megarl, pack sequences by <role>.megatron.use_remove_padding" in n for n in notes)
    for section, flagged in (("actor_rollout_ref.actor", {"actor_rollout_ref.actor", "actor_rollout_ref.ref"}),
                             ("actor_rollout_ref.ref", {"actor_rollout_ref.ref"})):  # the reference follows the actor
        problems = problems_of(*cp2, f"{section}.megatron.use_remove_padding=False")
        assert {p.key for p in problems} == {f"{s}.megatron.use_remove_padding" for s in flagged}
        assert all("context_parallel_size=2" in p.message for p in problems)
    assert load_config(None, [*VALID, "actor_rollout_ref.actor.megatron.use_remove_padding=False"])  # fine at CP1


def test_refused_keys_at_their_off_value_and_noted_keys_are_accepted():
    notes: list[str] = []
    load_config(None, [*VALID, "actor_rollout_ref.model.lora.rank=0", "actor_rollout_ref.model.lora.alpha=64",
                       "actor_rollout_ref.actor.profiler.enable=False", "actor_rollout_ref.actor.megatron.use_mbridge=True",
                       "actor_rollout_ref.model.use_fused_kernels=True", "data.return_raw_chat=True",
                       "actor_rollout_ref.rollout.mode=async", "trainer.device=cuda"], notes=notes)
    text = "\n".join(notes)
    assert "use_mbridge: megarl loads and exports Hugging Face checkpoints with its own bridge" in text
    assert "use_fused_kernels: megarl computes log-probs and entropy with its own vocab-parallel kernels" in text
    assert "rollout.mode=async" in text and "return_raw_chat" in text


def test_two_spellings_of_one_setting_map_onto_it_and_conflict_when_they_differ():
    cfg = load_config(None, [*VALID, "reward.reward_manager.name=dapo", "+reward.custom_reward_function.name=my_fn",
                             "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096"])
    assert cfg.reward_model.reward_manager == "dapo" and cfg.custom_reward_function.name == "my_fn"
    assert cfg.actor_rollout_ref.rollout.weight_sync.bucket_mb == 4096  # verl's checkpoint-engine bucket size
    text = messages("reward.reward_manager.name=dapo", "reward_model.reward_manager=batch")
    assert "reward.reward_manager.name=dapo and reward_model.reward_manager=batch are the same setting" in text
    text = messages("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
                    "actor_rollout_ref.rollout.weight_sync.bucket_mb=32")
    assert "update_weights_bucket_megabytes=64 and actor_rollout_ref.rollout.weight_sync.bucket_mb=32" in text


def test_micro_batch_keys_the_workers_need_are_checked_before_start():
    text = messages("actor_rollout_ref.actor.use_kl_loss=True")
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu is not set, and the reference model runs" in text
    load_config(None, [*VALID, "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True"])
    assert "rollout.log_prob_micro_batch_size_per_gpu=0: must be >= 1" in messages(
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0")
    assert "lr_decay_style='wsd': LR schedules are" in messages("actor_rollout_ref.actor.optim.lr_decay_style=wsd")



def test_a_wrong_parallel_size_does_not_hide_the_batch_problems():
    """One pass: TP=3 on 2 devices leaves the data-parallel size unknown, and the micro-batch that divides no
    mini-batch, the mini-batch that does not divide the batch and the critic's are still reported."""
    text = messages("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    assert "2 trainer devices is not divisible by actor_rollout_ref.actor.megatron TP x PP x CP = 3 x 1 x 1" in text
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=3 must divide data.train_batch_size=4" in text
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 must divide the 6 samples of a mini-batch" in text
    text = messages("trainer.placement=split", "trainer.rollout_gpus=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert "split placement needs 0 < rollout_gpus" in text and "ppo_micro_batch_size_per_gpu=3 must divide" in text


def test_the_global_micro_batch_key_with_its_per_gpu_form_is_refused_as_verl_does():
    problems = problems_of("actor_rollout_ref.actor.ppo_micro_batch_size=4")
    assert [p.key for p in problems] == ["actor_rollout_ref.actor.ppo_micro_batch_size"]
    assert "ppo_micro_batch_size=4 and actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 are both set" in problems[0].message
    rest = [o for o in VALID if "ppo_micro_batch_size_per_gpu" not in o]
    cfg = load_config(None, [*rest, "actor_rollout_ref.actor.ppo_micro_batch_size=4"])  # alone: verl's global form
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size == 4


def test_weight_sync_verify_and_log_val_generations_are_checked():
    assert "log_val_generations=3 logs validation samples, but data.val_files is not set" in messages(
        "trainer.log_val_generations=3")


# ------------------------------------------------------------------ every key is read
# ------------------------------------------------------------------ the CLIs, as a user runs them
@pytest.mark.heavy  # starts a process
def test_main_ppo_and_config_show_run_the_same_checks(tmp_path):
    model = write_model_config(tmp_path / "model")
    data = write_prompts(tmp_path / "train.parquet", rows=8, data_source="megarl/arithmetic")
    good = [f"data.train_files={data}", f"actor_rollout_ref.model.path={model}", *VALID[2:]]
    show = subprocess.run([sys.executable, "-m", "megarl.run.cli", "config", "show", *good, "trainer.logger=console"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert show.returncode == 0, show.stderr
    assert "project_name: megarl" in show.stdout
    bad = [*good, "actor_rollout_ref.model.path=/no/model", "custom_reward_function.path=/no/reward.py",
           "data.val_files=/no/val.parquet", "actor_rollout_ref.actor.ppo_epoch=2"]
    run = subprocess.run([sys.executable, "-m", "megarl.trainer.main_ppo", "--config-path=config",
                          "--config-name=ppo_megatron_trainer", *bad], capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    for expected in ("actor_rollout_ref.model.path=/no/model: no such directory",
                     "custom reward function file not found: '/no/reward.py'", "'/no/val.parquet' does not exist",
                     "Did you mean 'actor_rollout_ref.actor.ppo_epochs'"):
        assert expected in run.stderr, run.stderr
    assert "invalid config (4 problems)" in run.stderr


def test_console_keys_and_the_verbose_flag():
    assert parse_command_line(["--verbose", "a.b=1"]).verbose and parse_command_line(["-v"]).verbose
    assert not parse_command_line(["a.b=1"]).verbose
    cfg = load_config(None, [*VALID, "trainer.log_level=debug", "trainer.log_train_generations=2",
                             "trainer.rollout_data_dir=/tmp/rollouts"])  # verl's dump key, refused before issue 17
    assert (cfg.trainer.log_level, cfg.trainer.log_train_generations_freq, cfg.trainer.rollout_data_dir) == \
        ("debug", 10, "/tmp/rollouts")
    text = messages("trainer.log_level=LOUD", "trainer.log_train_generations=2", "trainer.log_train_generations_freq=0",
                    "trainer.validation_data_dir=/tmp/v")
    assert "trainer.log_level='LOUD': use INFO (default: a quiet console), DEBUG" in text
    assert "trainer.log_train_generations_freq=0: use a positive step count" in text
    assert "trainer.validation_data_dir=/tmp/v dumps validation samples, but data.val_files is not set" in text


def test_quickstart_help_and_a_bad_override_end_cleanly(monkeypatch, capsys):
    from megarl.logging import console
    from megarl.run import quickstart

    monkeypatch.setattr(quickstart, "prepare", lambda: None)  # the model and data are not needed to refuse
    monkeypatch.setattr(console, "setup_console", lambda level: None)  # pytest's logging stays as it is
    assert quickstart.main(["--help"]) == 0
    assert "make quickstart" in capsys.readouterr().out
    assert quickstart.main(["actor_rollout_ref.rollout.n=two"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "actor_rollout_ref.rollout.n" in err and "Traceback" not in err
