"""The pre-flight checks: what a run will read (models, data, reward function), before anything starts."""
from __future__ import annotations

import json
import re
import textwrap

import pytest

from megarl.checks import ConfigError, load_config
from megarl.models.locate import resolve_model_path
from tests.config._fixtures import write_model_config, write_prompts
from tests.data.data_helpers import verl_row, write_with_latin1

BATCH = ["algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
         "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]


@pytest.fixture()
def files(tmp_path):
    model = write_model_config(tmp_path / "model")
    data = write_prompts(tmp_path / "train.parquet", rows=8, data_source="megarl/arithmetic")
    return tmp_path, model, data


def check(*overrides: str) -> list:
    try:
        load_config(None, [*BATCH, *overrides], preflight=True)
    except ConfigError as exc:
        return [p.message for p in exc.problems]
    return []


def test_a_complete_run_passes(files):
    _, model, data = files
    assert check(f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"data.val_files={data}") == []


def test_hub_ids_resolve_through_the_cache_or_say_how_to_get_them(files, monkeypatch):
    import huggingface_hub.constants as hub

    root, _, data = files
    snapshot = root / "hub" / "models--acme--tiny-llm" / "snapshots" / ("0" * 40)
    write_model_config(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(root / "hub"))
    assert resolve_model_path("acme/tiny-llm") == str(snapshot)
    assert check("actor_rollout_ref.model.path=acme/tiny-llm", f"data.train_files={data}") == []
    (problem,) = check("actor_rollout_ref.model.path=acme/other", f"data.train_files={data}")
    assert "acme/other: not a local directory and not in the Hugging Face cache" in problem
    assert "huggingface-cli download acme/other" in problem


def test_model_directory_and_architecture(files):
    root, _, data = files
    (root / "empty").mkdir()
    assert check(f"actor_rollout_ref.model.path={root / 'empty'}", f"data.train_files={data}") == [
        f"actor_rollout_ref.model.path={root / 'empty'}: {root / 'empty'} has no config.json; give a Hugging Face "
        "checkpoint directory (megarl make-tiny-model writes one)"]
    phi = write_model_config(root / "phi", "Phi3ForCausalLM", "phi3")
    (problem,) = check(f"actor_rollout_ref.model.path={phi}", f"data.train_files={data}")
    assert "the Phi3ForCausalLM architecture is not supported" in problem and "LlamaForCausalLM" in problem


def test_data_files_columns_rows_and_sources(files):
    root, model, data = files
    no_source = write_prompts(root / "no_source.parquet", rows=8, data_source=None)
    few = write_prompts(root / "few.parquet", rows=2)
    geo = write_prompts(root / "geo.parquet", rows=8, data_source="searchR1_nq")
    mine = write_prompts(root / "mine.parquet", rows=8, data_source="my/dataset")
    got = check(f"actor_rollout_ref.model.path={model}", f"data.train_files=[{no_source},{few}]",
                f"data.val_files=[{geo},{mine},{root / 'gone.parquet'}]")
    text = "\n".join(got)
    assert f"{no_source}: missing column(s) ['data_source']" in text and "set custom_reward_function.path" in text
    assert "data.train_files hold 10 rows" not in text  # only files whose columns are fine count
    assert "'searchR1_nq' (column 'data_source'): verl's built-in reward for searchR1_nq" in text
    assert "no built-in reward for the data source(s) ['my/dataset']" in text
    assert f"'{root / 'gone.parquet'}' does not exist" in text
    assert "data.train_files hold 2 rows, fewer than data.train_batch_size=4" in check(
        f"actor_rollout_ref.model.path={model}", f"data.train_files={few}")[0]
    # data.reward_fn_key names the column; a custom reward needs none
    renamed = write_prompts(root / "renamed.parquet", rows=8, data_source=None,
                            extra_columns={"task": ["megarl/arithmetic"] * 8})
    assert check(f"actor_rollout_ref.model.path={model}", f"data.train_files={renamed}", "data.reward_fn_key=task") == []
    # a data source that is not UTF-8 (Latin-1 bytes in the string column): named by file, row and key
    latin1 = write_with_latin1([verl_row("q", "1", i, data_source="café/arith") for i in range(8)],
                               root / "latin1.parquet", bad_row=5, column="data_source")
    (problem,) = check(f"actor_rollout_ref.model.path={model}", f"data.train_files={latin1}")
    assert problem.startswith(f"{latin1}: row 5: key 'data_source': the text is not valid UTF-8 (byte 0xe9"), problem


REWARDS = textwrap.dedent('''
    import asyncio

    def per_sample(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == str(ground_truth))

    def seed_batch(responses, ground_truths):
        return [float(r.strip() == str(g)) for r, g in zip(responses, ground_truths)]

    def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        return [0.0 for _ in solution_strs]

    async def per_sample_async(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return 1.0

    def bad(solution_str):
        return 0.0
''')


def test_reward_file_and_signature(files):
    root, model, data = files
    path = root / "rewards.py"
    path.write_text(REWARDS)
    no_source = write_prompts(root / "no_source.parquet", rows=8, data_source=None)
    common = [f"actor_rollout_ref.model.path={model}", f"data.train_files={no_source}",
              f"custom_reward_function.path={path}"]
    for name in ("per_sample", "seed_batch", "verl_batch", "per_sample_async"):
        assert check(*common, f"custom_reward_function.name={name}") == [], name
    (problem,) = check(*common, "custom_reward_function.name=bad")
    assert "has the signature (solution_str), which fits none of the reward forms" in problem
    (problem,) = check(*common, "custom_reward_function.name=nothere")
    assert "function 'nothere' not found" in problem and "per_sample" in problem
    (problem,) = check(*common, "custom_reward_function.name=per_sample", "reward_model.reward_manager=batch")
    assert "reward_manager=batch calls the reward function once per batch" in problem
    (problem,) = check(*common, "custom_reward_function.name=seed_batch", "reward.num_workers=2")
    assert "reward.num_workers=2" in problem and "set reward.num_workers=1" in problem
    (problem,) = check(f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
                       f"custom_reward_function.path={root / 'none.py'}")
    assert "custom reward function file not found" in problem


def test_overlong_penalty_settings_are_checked(files):
    _, model, data = files
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}"]
    assert check(*base, "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64") == [
        "reward_model.reward_kwargs.overlong_buffer_cfg: the naive reward manager takes no keyword arguments "
        "(the overlong penalty needs reward_manager=dapo)"]
    assert "the overlong penalty is applied by the dapo reward manager; set reward_model.reward_manager=dapo" in check(
        *base, "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=64")[0]
    text = "\n".join(check(*base, "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096", "+reward_model.reward_kwargs.max_resp_len=512",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.window=3", "reward_model.overlong_buffer.enable=True"))
    assert "overlong_buffer_cfg.window: unknown" in text
    assert "both turn on the overlong penalty; keep one" in text
    assert "takes no keyword arguments" in "\n".join(check(*base, "+reward_model.reward_kwargs.max_resp_len=8"))
    assert check(*base, "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
                 "reward_model.overlong_buffer.len=100") == []
    assert "exceeds the max response length 512" in check(
        *base, "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
        "reward_model.overlong_buffer.len=1000")[0]


@pytest.mark.parametrize("fields, override, message", [
    ({}, "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
     "actor_rollout_ref.rollout.tensor_model_parallel_size=3: vLLM cannot split actor_rollout_ref.model.path=.* over 3 "
     "ranks: num_attention_heads=4 is not divisible by tp=3"),
    ({"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 384}, "actor_rollout_ref.rollout.tensor_model_parallel_size=6",
     "tp=6 is not a multiple of num_key_value_heads=4"),
    ({"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 384}, "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
     "num_key_value_heads=4 is not divisible by tp=3"),
    ({"intermediate_size": 250}, "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "intermediate_size=250 is not divisible by tp=4"),
    ({}, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
     r"actor_rollout_ref.actor.megatron.\* for actor_rollout_ref.model.path=.*num_attention_heads=4 is not divisible by tp=3"),
])
def test_tp_that_does_not_split_the_model_fails_before_start(tmp_path, fields, override, message):
    """vLLM's and megatron's own splitting rules, checked against config.json before anything starts (they
    used to fail 90-100 s into a launch, after Ray, with vLLM's or torch's raw error)."""
    model = write_model_config(tmp_path / "model", **{"intermediate_size": 256, **fields})
    data = write_prompts(tmp_path / "train.parquet", rows=24, data_source="megarl/arithmetic")
    sizes = ["trainer.n_gpus_per_node=12", "data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
             "trainer.plan_check=False"]  # 12 ranks and engines for GPUs: whether they fit this CPU host is not the point
    (problem,) = check(f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", *sizes, override)
    assert re.search(message, problem), problem
    # a TP that splits every count passes; fewer KV heads than ranks are replicated (tp=4, 2 KV heads)
    assert check(f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", *sizes,
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=4" if not fields else
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2") == []


def test_moe_under_tensor_parallelism_needs_its_experts_split(tmp_path):
    """TP=2 with EP=1 and ETP=1 trains whole experts on each TP rank's share of the tokens, and megatron does not
    sum those gradients over the TP ranks (measured: a tiny GLM-4.5 MoE at TP2+SP served the fleet weights 4e-3
    away from the trainer's after one step); refused naming both ways to split the experts, which pass."""
    model = write_model_config(tmp_path / "model", "Qwen3MoeForCausalLM", "qwen3_moe", intermediate_size=256,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32)
    data = write_prompts(tmp_path / "train.parquet", rows=8, data_source="megarl/arithmetic")
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.sequence_parallel=True"]
    (problem,) = check(*base)
    assert ("expert_model_parallel_size=1 and expert_tensor_parallel_size=1 for a MoE model" in problem
            and "expert_tensor_parallel_size=2" in problem and "expert_model_parallel_size > 1" in problem), problem
    assert check(*base, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2") == []
    assert check(*base, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1") == []


def test_checkpoints_to_start_or_resume_from_are_whole(files):
    """A truncated file of the checkpoint a run starts from, and a run directory whose checkpoints
    cannot be resumed, are named before anything starts."""
    import os

    from tests.config._fixtures import write_saved_checkpoint

    root, model, data = files
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}"]
    start = write_saved_checkpoint(root / "converted", "mcore", 0)
    os.truncate(start / "__0_1.distcp", 100)
    problems = check(*base, "actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                     f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={root / 'converted' / 'mcore'}")
    assert problems == [f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={root / 'converted' / 'mcore'}: "
                        "__0_1.distcp has 100 bytes, the manifest records 3000 (truncated or overwritten)"]
    run = root / "run"
    os.truncate(write_saved_checkpoint(run, "actor", 5) / "common.pt", 0)
    problems = check(*base, f"trainer.default_local_dir={run}")
    assert len(problems) == 1 and "holds checkpoints (actor/step_5) but none can be resumed" in problems[0]
    assert "common.pt has 0 bytes" in problems[0] and "trainer.resume_mode=disable" in problems[0]
    assert check(*base, f"trainer.default_local_dir={run}", "trainer.resume_mode=disable") == []


def test_a_resume_keeps_the_lora_settings_its_checkpoint_was_trained_with(files):
    """Rank, alpha, type and targets shape or scale the adapters: a resume under others is refused before start."""
    from megarl.engine.checkpoint import META_FILE
    from megarl.engine.manifest import write_manifest
    from megarl.models.lora import LoRASettings
    from tests.config._fixtures import write_saved_checkpoint

    root, model, data = files
    run = root / "lora_run"
    step = write_saved_checkpoint(run, "actor", 2)
    meta = json.loads((step / META_FILE).read_text())
    saved = LoRASettings(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"), type="canonical_lora")
    (step / META_FILE).write_text(json.dumps({**meta, "model_part": "trainable", "lora": saved.to_dict()}))
    write_manifest(step)
    lora = "actor_rollout_ref.model.lora"
    same = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"trainer.default_local_dir={run}",
            f"{lora}.rank=8", f"{lora}.alpha=16", f"{lora}.target_modules=[q_proj,v_proj]", f"{lora}.type=canonical_lora"]
    assert check(*same) == []
    (problem,) = check(*same, f"{lora}.rank=16", f"{lora}.type=lora")
    assert f"resuming {step}" in problem and "rank: 8 there, 16 here" in problem
    assert "type: 'canonical_lora' there, 'lora' here" in problem and "trainer.resume_mode=disable" in problem
    (problem,) = check(*same[:3])  # no LoRA now
    assert "it holds a LoRA run's adapters" in problem and f"{lora}.rank=0" in problem
    assert check(*same[:3], f"{lora}.rank=16", "trainer.resume_mode=disable") == []
