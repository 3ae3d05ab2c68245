"""verl's 2026 schema (verl-project/verl, August 2026), key by key: what megarl honours, maps and refuses.

The launches themselves are in test_verl_launches.py; here each new form is shown on its own.
"""
from __future__ import annotations

import pytest

from megarl.checks import ConfigError, load_config

ACTOR, ROLLOUT, RC = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "algorithm.rollout_correction"
VALID = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
         "trainer.n_gpus_per_node=2", "data.train_batch_size=4", f"{ROLLOUT}.n=2",
         f"{ACTOR}.ppo_mini_batch_size=2", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2",
         f"{ROLLOUT}.tensor_model_parallel_size=1"]


def load(*overrides: str, notes: list | None = None):
    return load_config(None, [*VALID, *overrides], notes=notes)


def problems(*overrides: str) -> list:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    return info.value.problems


@pytest.mark.parametrize("key", ["model_engine", f"{ACTOR}.model_engine", "critic.model_engine"])
def test_model_engine_megatron_is_what_megarl_runs_and_other_engines_are_refused(key):
    load(f"{key}=megatron")
    for engine in ("dp", "fsdp", "veomni", "torchtitan"):
        (refused,) = problems(f"{key}={engine}")
        assert refused.is_refusal and refused.feature == "training engines other than megatron-core"
        assert "megarl trains every role with megatron-core" in refused.message and f"{key}={engine}" in refused.message


def test_the_old_spellings_keep_working_next_to_the_selector():
    cfg = load("model_engine=megatron", f"{ACTOR}.strategy=megatron")
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size >= 1


def test_a_float_like_threshold_string_is_the_float():
    cfg = load(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold='3.5'")
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 3.5


def test_a_lower_upper_rejection_threshold_sets_both_bounds():
    cfg = load(f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=0.5_4.0")
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower) == (4.0, 0.5)
    (clash,) = problems(f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=0.5_4.0",
                        f"{RC}.rollout_rs_threshold_lower=0.25")
    assert "give one of them" in clash.message


def test_a_lower_upper_importance_threshold_is_icepop_and_honoured():
    from megarl.algorithms.rollout_correction import RolloutCorrection

    cfg = load(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_4.0")
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is_threshold, rc.rollout_is_threshold_lower) == (4.0, 0.5)
    settings = RolloutCorrection.from_config(rc)  # what the trainer and the engine are given
    assert settings.icepop and (settings.rollout_is_threshold_lower, settings.rollout_is_threshold) == (0.5, 4.0)
    (clash,) = problems(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_4.0",
                        f"{RC}.rollout_is_threshold_lower=0.25")
    assert "give one of them" in clash.message
    (inverted,) = problems(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=4.0_0.5")
    assert "IcePop's lower bound needs 0 <= lower <= rollout_is_threshold" in inverted.message


@pytest.mark.parametrize("override, feature", [
    (f"{ACTOR}.megatron.use_megatron_fsdp=True", "Megatron-FSDP"),
    (f"{ACTOR}.checkpoint.strict=False", "lenient checkpoint loads"),
    (f"{ACTOR}.megatron.dynamic_context_parallel=True", "dynamic context-parallel"),
    (f"{ACTOR}.megatron.qat.enable=True", "quantization-aware training"),
    (f"{ACTOR}.optim.exp_avg_dtype=bf16", "low-precision"),
    (f"{ROLLOUT}.moe_tensor_parallel_size=2", "tensor-parallel size for the rollout's experts"),
    (f"{ROLLOUT}.disaggregation.enabled=True", "disaggregation"),
    ("ray_kwargs.ray_init.runtime_env.py_executable=/opt/py/bin/python3", "another interpreter"),
    ("algorithm.filter_groups.max_inflight_gen_batches=2", "in flight"),
    (f"{ACTOR}.router_replay.mode=R3", "router replay from the rollout engine"),
])
def test_new_keys_that_ask_for_a_missing_feature_are_refused_by_name(override, feature):
    refusals = [p for p in problems(override) if p.is_refusal]
    assert any(feature in p.feature for p in refusals), [p.message for p in refusals]


def test_verls_defaults_of_the_new_keys_ask_for_nothing():
    load(f"{ACTOR}.megatron.use_megatron_fsdp=False", f"{ACTOR}.checkpoint.strict=True",
         f"{ACTOR}.optim.exp_avg_dtype=fp32", f"{ROLLOUT}.moe_tensor_parallel_size=1",
         f"{ROLLOUT}.disaggregation.enabled=False", "algorithm.filter_groups.max_inflight_gen_batches=1",
         f"{ACTOR}.optim.use_layer_wise_distributed_optimizer=False")


def test_verls_uv_launch_wrapper_is_accepted_with_a_note():
    notes: list[str] = []
    load("ray_kwargs.ray_init.runtime_env.py_executable='uv -v run --frozen --all-packages --extra vllm "
         "--extra megatron'", notes=notes)
    assert any("driver's interpreter" in note for note in notes), notes


def test_precision_aware_optimizer_key_is_megatron_cores_field():
    cfg = load(f"{ACTOR}.optim.use_precision_aware_optimizer=True")
    assert cfg.actor_rollout_ref.actor.optim.override_optimizer_config["use_precision_aware_optimizer"] is True
    cfg = load(f"{ACTOR}.optim.use_precision_aware_optimizer=False")  # verl's default: megatron-core's default
    assert "use_precision_aware_optimizer" not in cfg.actor_rollout_ref.actor.optim.override_optimizer_config


def test_the_rollout_pool_size_under_the_rollout_section_is_the_pool():
    cfg = load(f"{ROLLOUT}.nnodes=1", f"{ROLLOUT}.n_gpus_per_node=2", "async_training.mode=one_step_off",
               f"{RC}.bypass_mode=True")
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 2)


def test_max_model_len_in_vllms_engine_arguments_is_the_rollouts_key():
    cfg = load("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=4096")
    assert cfg.actor_rollout_ref.rollout.max_model_len == 4096
    assert "max_model_len" not in cfg.actor_rollout_ref.rollout.engine_kwargs["vllm"]
    clash = problems("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=4096",
                     "actor_rollout_ref.rollout.max_model_len=2048")
    assert any("give one of them" in p.message for p in clash)


def _override_problems(overrides: dict, megatron: dict | None = None) -> list:
    """The engine-key check's problems for the actor's override_transformer_config (no model config here)."""
    from megarl.checks.engine_keys import engine_key_problems

    cfg = load()
    for name, value in (megatron or {}).items():
        cfg.actor_rollout_ref.actor.megatron[name] = value
    cfg.actor_rollout_ref.actor.megatron.override_transformer_config = overrides
    return engine_key_problems(cfg, with_critic=False)


@pytest.mark.parametrize("name, value, feature", [
    ("use_flash_attn", True, "MindSpeed"), ("use_fused_rmsnorm", True, "MindSpeed"), ("swiglu", True, "MindSpeed"),
    ("apply_dsa_kernel_fusion", True, "DeepSeek-V4"), ("use_fused_mhc", True, "DeepSeek-V4"),
    ("pipeline_model_parallel_layout", "Et*6|t*6L", "pipeline layouts by layer-type string"),
])
def test_other_megatron_builds_fields_are_refused_by_what_they_belong_to(name, value, feature):
    found = _override_problems({name: value})
    assert any(getattr(p, "feature", None) and feature in p.feature for p in found), found


def test_a_layout_field_repeated_in_the_overrides_with_the_same_value_is_accepted():
    assert not _override_problems({"sequence_parallel": True}, {"sequence_parallel": True})
    assert any("set it with" in str(p) for p in _override_problems({"sequence_parallel": False},
                                                                      {"sequence_parallel": True}))


@pytest.mark.parametrize("verl_name, level", [("token_k1", "token"), ("seq_sum_k1", "sequence"),
                                              ("seq_mean_k1", "geometric")])
def test_verls_ratio_bound_rejection_levels_are_megarls_levels(verl_name, level):
    notes: list[str] = []
    cfg = load(f"{RC}.rollout_rs={verl_name}", f"{RC}.rollout_rs_threshold=0.5_2.0", notes=notes)
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower) == (level, 2.0, 0.5)
    assert any(f"read as {RC}.rollout_rs={level}" in note for note in notes)


@pytest.mark.parametrize("value", ["token_k2", "seq_max_k3", "'token_k1,seq_sum_k1'"])
def test_divergence_bound_and_combined_rejection_levels_are_refused(value):
    refusals = [p for p in problems(f"{RC}.rollout_rs={value}", f"{RC}.rollout_rs_threshold=2.0") if p.is_refusal]
    assert any("divergence bound" in p.feature and "seq_sum_k1" in p.message for p in refusals), refusals


def test_rollout_expert_parallelism_is_honoured_on_a_moe_model(tmp_path):
    """verl's rollout.expert_parallel_size: 1 or the TP size (EP = TP x DP, DP is 1 in megarl's engines), on a model
    with routed experts; its data_parallel_size above 1 is refused with the alternative."""
    from megarl.devtools.tiny_model import make_tiny_model

    from tests.config._fixtures import write_prompts

    moe = make_tiny_model("qwen3_moe", "tiny", out_dir=tmp_path / "moe")
    dense = make_tiny_model("qwen2", "tiny", out_dir=tmp_path / "dense")
    tp2 = [f"{ROLLOUT}.tensor_model_parallel_size=2", "trainer.plan_check=False",
           f"data.train_files={write_prompts(tmp_path / 'train.parquet', rows=16)}"]

    def preflight(model, *overrides):
        return load_config(None, [*VALID, *tp2, f"actor_rollout_ref.model.path={model}", *overrides], preflight=True)

    cfg = preflight(moe, f"{ROLLOUT}.expert_parallel_size=2", f"{ROLLOUT}.data_parallel_size=1")
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 2
    with pytest.raises(ConfigError, match="has no routed experts"):
        preflight(dense, f"{ROLLOUT}.expert_parallel_size=2")
    with pytest.raises(ConfigError, match=r"expert_parallel_size=4: vLLM's expert parallelism spans one engine's ranks"):
        preflight(moe, f"{ROLLOUT}.expert_parallel_size=4")
    (refused,) = problems(*tp2, f"{ROLLOUT}.data_parallel_size=2", f"{ROLLOUT}.expert_parallel_size=4")
    assert refused.is_refusal and refused.feature == "data parallelism inside one rollout engine"
    assert "num_replicas" in refused.message


def test_rollout_expert_parallelism_on_a_cpu_host_is_refused_before_anything_starts(tmp_path, monkeypatch):
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.plan import hardware
    from tests.config._fixtures import write_prompts

    monkeypatch.setattr(hardware, "local_gpu", lambda: None)
    moe = make_tiny_model("qwen3_moe", "tiny", out_dir=tmp_path / "moe")
    with pytest.raises(ConfigError, match="SIGSEGV in cpu_fused_moe"):
        load_config(None, [*VALID, f"{ROLLOUT}.tensor_model_parallel_size=2", f"actor_rollout_ref.model.path={moe}",
                           f"data.train_files={write_prompts(tmp_path / 'train.parquet', rows=16)}",
                           f"{ROLLOUT}.expert_parallel_size=2"], preflight=True)
