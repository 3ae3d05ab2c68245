"""verl's LoRA keys on megarl: ``model.lora.*`` (Megatron), ``model.lora_rank`` & co (FSDP), ``critic.model.lora.*``;
their checks before anything starts, against the model too."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.checks import load_config
from megarl.settings.engine import lora_settings
from tests.config._fixtures import problem_messages, write_model_config, write_prompts

BATCH = ["algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
         "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
VALID = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m", *BATCH]
LORA = "actor_rollout_ref.model.lora"
HERE = Path(__file__).parent / "verl_launches" / "config"


def problems(*overrides: str, preflight: bool = False) -> list[str]:
    return problem_messages(*overrides, preflight=preflight)


def test_verls_megatron_lora_keys_are_the_engines_settings():
    cfg = load_config(None, [*VALID, f"{LORA}.rank=16", f"{LORA}.alpha=64", f"{LORA}.dropout=0.05",
                             f"{LORA}.lora_A_init_method=kaiming", f"{LORA}.target_modules=[linear_qkv,linear_fc1]",
                             f"{LORA}.exclude_modules=[k_proj]", "actor_rollout_ref.actor.megatron.seed=5"])
    s = lora_settings(cfg, "actor")
    assert (s.rank, s.alpha, s.scale, s.dropout, s.lora_A_init_method, s.lora_B_init_method, s.seed) == \
        (16, 64.0, 4.0, 0.05, "kaiming", "zero", 5)
    assert s.target_modules == ("linear_qkv", "linear_fc1") and s.exclude_modules == ("k_proj",)
    assert lora_settings(cfg, "ref") is None and lora_settings(cfg, "critic") is None
    assert cfg.actor_rollout_ref.model.lora.merge is False  # verl's default: adapter-only updates
    assert lora_settings(load_config(None, VALID), "actor") is None  # rank 0: no LoRA


def test_fsdp_style_keys_map_onto_the_same_settings_and_conflict_when_both_differ():
    cfg = load_config(None, [*VALID, "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                             "actor_rollout_ref.model.target_modules=all-linear"])
    s = lora_settings(cfg, "actor")
    assert (s.rank, s.alpha, s.target_modules) == (8, 16.0, ("all-linear",))
    (problem,) = problems(*VALID, "actor_rollout_ref.model.lora_rank=8", f"{LORA}.rank=16")
    assert "actor_rollout_ref.model.lora_rank=8" in problem and f"{LORA}.rank=16" in problem and "two spellings" in problem
    # while lora_rank is 0 the FSDP keys are inert: verl's default lora_alpha=16 does not touch lora.alpha
    cfg = load_config(None, [*VALID, "actor_rollout_ref.model.lora_alpha=16", f"{LORA}.rank=4"])
    assert lora_settings(cfg, "actor").alpha == 32.0


def test_verls_generated_config_with_lora_on_keeps_the_megatron_values():
    cfg = load_config("_generated_ppo_megatron_trainer", [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4", f"{LORA}.rank=32"], config_path=HERE)
    s = lora_settings(cfg, "actor")
    assert (s.rank, s.alpha, s.lora_A_init_method) == (32, 32.0, "xavier")  # not the FSDP block's lora_alpha: 16
    assert s.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_bad_lora_values_and_features_megarl_lacks_are_named():
    found = problems(*VALID, f"{LORA}.rank=8", f"{LORA}.type=dora", f"{LORA}.dropout_position=post",
                     f"{LORA}.lora_B_init_method=orthogonal", f"{LORA}.alpha=0", f"{LORA}.lora.dtype=fp16")
    text = "\n".join(found)
    assert "DoRA" in text and "lora.type=dora" in text and text.count("type=dora") == 1
    assert not problems(*VALID, f"{LORA}.rank=8", f"{LORA}.type=canonical_lora")  # one A per projection: honoured
    assert lora_settings(load_config(None, [*VALID, f"{LORA}.rank=8", f"{LORA}.type=canonical_lora"]),
                         "actor").canonical
    assert "dropout_position=post" in text and "dropout_position=pre" in text
    assert "lora_B_init_method='orthogonal'" in text and "alpha=0.0: must be > 0" in text
    assert any("unknown config key" in p and "lora.lora.dtype" in p for p in found)
    (problem,) = problems(*VALID, f"{LORA}.dtype=fp16")
    assert "adapter dtype apart from the model's" in problem
    (problem,) = problems(*VALID, f"{LORA}.adapter_path=/a")
    assert "needs actor_rollout_ref.model.lora.rank > 0" in problem
    (problem,) = problems(*VALID, f"{LORA}.rank=-1")
    assert "use 0 (no LoRA)" in problem


def test_adapter_only_updates_need_the_fleets_base(tmp_path):
    (problem,) = problems(*VALID, f"{LORA}.rank=8", f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={tmp_path}")
    assert "merge=False sends only the adapter" in problem and "set actor_rollout_ref.model.lora.merge=True" in problem
    assert problems(*VALID, f"{LORA}.rank=8", f"{LORA}.merge=True",
                    f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={tmp_path}") == []


@pytest.fixture()
def files(tmp_path):
    model = write_model_config(tmp_path / "model", "LlamaForCausalLM", "llama", intermediate_size=256)
    moe = write_model_config(tmp_path / "moe", "Qwen3MoeForCausalLM", "qwen3_moe", intermediate_size=256,
                             moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, head_dim=32)
    data = write_prompts(tmp_path / "train.parquet", rows=8, data_source="megarl/arithmetic")
    return tmp_path, model, moe, data


def test_target_names_are_checked_against_the_model(files):
    _, model, _, data = files
    run = [*BATCH, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"{LORA}.rank=8"]
    assert problems(*run, f"{LORA}.target_modules=[q_proj,v_proj,down_proj]", preflight=True) == []
    assert problems(*run, f"{LORA}.target_modules=[all-linear]", f"{LORA}.exclude_modules=['decoder.layers.1.*']",
                    preflight=True) == []
    (problem,) = problems(*run, f"{LORA}.target_modules=[linear_qkv,qkv_proj,gate]", preflight=True)
    assert "['qkv_proj', 'gate'] match no linear of this model" in problem
    assert "linear_fc1" in problem and "gate_proj" in problem  # the names it has, both spellings


def test_expert_adapters_need_expert_tensor_parallel_size_1(files):
    _, _, moe, data = files
    run = [*BATCH, f"actor_rollout_ref.model.path={moe}", f"data.train_files={data}", f"{LORA}.rank=8",
           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.actor.megatron.sequence_parallel=True",
           "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    (problem,) = problems(*run, preflight=True)
    assert "expert_tensor_parallel_size=1 (got 2)" in problem and "exclude_modules: ['*.experts.*']" in problem
    assert problems(*run, f"{LORA}.exclude_modules=['*.experts.*']", preflight=True) == []


def test_expert_adapters_need_per_expert_linears_not_grouped_gemm(files):
    _, _, moe, data = files
    grouped = "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True"
    run = [*BATCH, f"actor_rollout_ref.model.path={moe}", f"data.train_files={data}", f"{LORA}.rank=8", grouped]
    (problem,) = problems(*run, preflight=True)
    assert "per-expert linears (SequentialMLP)" in problem and "moe_grouped_gemm=True" in problem
    assert problems(*run, f"{LORA}.exclude_modules=['*.experts.*']", preflight=True) == []


def peft_adapter(model: Path, out: Path, target_modules: list[str], r: int = 8, alpha: int = 16) -> Path:
    """A real PEFT adapter (PEFT's default init: a random A per projection, B zero) on a random model of ``model``'s
    config.json."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    import torch
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules)).save_pretrained(out)
    return out


def test_adapter_path_must_be_an_adapter_of_this_rank_and_alpha(files):
    root, model, _, data = files
    run = [*BATCH, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"{LORA}.rank=8",
           f"{LORA}.alpha=16"]
    adapter = peft_adapter(model, root / "adapter", ["o_proj"])
    assert problems(*run, f"{LORA}.adapter_path={adapter}", f"{LORA}.target_modules=[o_proj]", preflight=True) == []
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 32}))
    (problem,) = problems(*run, f"{LORA}.adapter_path={adapter}", preflight=True)
    assert "lora_alpha=32 but the run's lora.alpha=16.0" in problem and "rescales it" in problem
    (problem,) = problems(*run, f"{LORA}.adapter_path={root / 'nowhere'}", preflight=True)
    assert "no such directory" in problem


def test_a_peft_adapter_with_an_a_per_projection_needs_canonical_lora_and_is_checked_before_start(files):
    """PEFT's default adapter on q_proj and v_proj (each its own A) against lora.type=lora's fused linear_qkv (one
    A): refused by the config check, naming the projections and canonical_lora, which takes it."""
    root, model, _, data = files
    run = [*BATCH, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"{LORA}.rank=8",
           f"{LORA}.alpha=16", f"{LORA}.target_modules=[q_proj,v_proj]"]
    adapter = peft_adapter(model, root / "qv", ["q_proj", "v_proj"])
    (problem,) = problems(*run, f"{LORA}.adapter_path={adapter}", preflight=True)
    assert f"{LORA}.adapter_path: {adapter}: q_proj, v_proj of model.layers.0.self_attn have different lora_A" in problem
    assert "shares one A across the fused linear_qkv" in problem and "lora.type=canonical_lora" in problem
    assert "lora_A, lora_A" not in problem
    assert not problems(*run, f"{LORA}.type=canonical_lora", f"{LORA}.adapter_path={adapter}", preflight=True)
    (problem,) = problems(*run[:-1], f"{LORA}.target_modules=[q_proj]", f"{LORA}.adapter_path={adapter}", preflight=True)
    assert "does not cover exactly the projections this run adapts" in problem and "v_proj.lora_A" in problem


def test_the_critics_own_lora(files):
    _, model, _, data = files
    cfg = load_config(None, [*BATCH, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
                             "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
                             "critic.model.lora.rank=4", "critic.model.lora_rank=0"], preflight=True)
    assert lora_settings(cfg, "critic").rank == 4 and lora_settings(cfg, "actor") is None
    (problem,) = problems(*BATCH, f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
                          "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
                          "critic.model.lora.rank=4", "critic.model.lora.type=dora")
    assert "critic.model.lora.type=dora" in problem
