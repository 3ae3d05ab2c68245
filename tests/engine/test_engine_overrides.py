"""verl's megatron override dicts and the engine-side keys, without processes.

The pipeline split is checked against megatron-core's own layer placement functions; the
validation messages are checked for naming the key and the fix; the batch balancing and the
checkpoint retention are checked on their own.
"""

import pytest
import torch

from megarl.checks import ConfigError, load_config
from megarl.engine import balanced_partitions
from megarl.settings.engine import model_overrides
from megarl.engine.overrides import pipeline_stage_layers, transformer_overrides, without_cpu_conflicts
from megarl.models import ParallelLayout
from megarl.trainer.checkpointing import prune_checkpoints
from megarl.settings.engine import layout_from_config

BASE = ["data.train_files=x.parquet", "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
OTC = "+actor_rollout_ref.actor.megatron.override_transformer_config."


def config(*overrides, model="/nonexistent", validate=True):
    return load_config(None, [*BASE, f"actor_rollout_ref.model.path={model}", *overrides], validate=validate)


def problems(*overrides, model="/nonexistent") -> str:
    with pytest.raises(ConfigError) as info:
        config(*overrides, model=model)
    return str(info.value)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    return make_tiny_model("qwen2", "small", tmp_path_factory.mktemp("m") / "small", seed=0)  # 4 layers


# ------------------------------------------------------------------ recompute and the gradient-checkpointing rule
def test_recompute_fields_reach_every_role_and_the_shorthand_yields_to_them():
    cfg = config(OTC + "recompute_granularity=full", OTC + "recompute_method=block", OTC + "recompute_num_layers=1",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=true", validate=False)
    expected = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
    assert model_overrides(cfg, "actor") == expected
    assert model_overrides(cfg, "ref") == expected  # the reference inherits the actor's, as in verl
    assert model_overrides(cfg, "critic") == {}  # the critic has its own section
    shorthand = config("actor_rollout_ref.model.enable_gradient_checkpointing=true", validate=False)
    assert model_overrides(shorthand, "actor") == {"recompute_granularity": "full", "recompute_method": "uniform",
                                                   "recompute_num_layers": 1}
    # the shorthand keeps a method / unit size given with it
    assert transformer_overrides({"recompute_method": "block", "recompute_num_layers": 2}, True) == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}
    # verl's printed defaults (recompute_modules without a granularity) mean: no recompute
    assert transformer_overrides({"recompute_granularity": None, "recompute_modules": ["core_attn"]}) == {}
    assert transformer_overrides({"attention_backend": "flash"})["attention_backend"].name == "flash"


def test_cpu_flags_win_over_fusion_overrides_on_a_machine_without_cuda():
    kept = without_cpu_conflicts({"gradient_accumulation_fusion": True, "recompute_granularity": "full"},
                                 {"gradient_accumulation_fusion": False}, "actor")
    assert kept == {"recompute_granularity": "full"}


# ------------------------------------------------------------------ uneven pipeline stages
@pytest.mark.parametrize("num_layers, pp, fields", [
    (14, 4, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}),
    (15, 4, {"account_for_embedding_in_pipeline_split": True}),
    (15, 4, {"account_for_loss_in_pipeline_split": True}),
    (6, 2, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}),
    (61, 16, {"num_layers_in_first_pipeline_stage": 4, "num_layers_in_last_pipeline_stage": 1}),  # verl's 671B script
])
def test_pipeline_split_places_layers_as_megatron_does(num_layers, pp, fields):
    """The layout's stages equal megatron-core's own placement with the same TransformerConfig fields."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    first, last = pipeline_stage_layers(fields, num_layers, pp)
    layout = ParallelLayout(pp=pp, first_stage_layers=first, last_stage_layers=last)
    megatron = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                 pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **fields)
    for stage in range(pp):
        offset = get_transformer_layer_offset(megatron, vp_stage=None, pp_rank=stage)
        count = get_num_layers_to_build(megatron, vp_stage=None, pp_rank=stage)
        assert layout.chunk_layers(num_layers, stage) == list(range(offset, offset + count)), stage


def test_uneven_stages_flow_from_the_overrides_into_the_layout():
    cfg = config("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                 OTC + "num_layers_in_first_pipeline_stage=1", validate=False)
    layout = layout_from_config(cfg.actor_rollout_ref.actor.megatron, 4)
    assert (layout.first_stage_layers, layout.last_stage_layers) == (1, None)
    assert layout.stage_layer_counts(4) == [1, 3]
    assert "num_layers_in_first_pipeline_stage" not in model_overrides(cfg, "actor")  # the layout carries it
    assert pipeline_stage_layers({"account_for_loss_in_pipeline_split": True}, 4, pp=1) == (None, None)


# ------------------------------------------------------------------ validation before any process starts
def test_unknown_and_megarl_owned_fields_are_refused_by_name():
    message = problems(OTC + "recompute_granulrity=full", OTC + "tensor_model_parallel_size=2", OTC + "bf16=true",
                       OTC + "vocab_size=1024",
                       "+actor_rollout_ref.actor.optim.override_optimizer_config.lr=1",
                       "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offlod=true",
                       "+critic.optim.override_optimizer_config.optimizer_cpu_offload=true", "critic.enable=true",
                       "critic.ppo_micro_batch_size_per_gpu=2")
    lines = message.splitlines()
    assert any("override_transformer_config.recompute_granulrity" in l and "closest: recompute_granularity" in l for l in lines)
    assert any("tensor_model_parallel_size: set it with actor_rollout_ref.actor.megatron.tensor_model_parallel_size" in l
               for l in lines)
    assert any("bf16: the dtype is set by the platform" in l for l in lines)
    assert any("vocab_size: the vocabulary comes from the HF config" in l for l in lines)
    assert any("override_optimizer_config.lr: set it with actor_rollout_ref.actor.optim.lr" in l for l in lines)
    assert any("optimizer_cpu_offlod" in l and "closest: optimizer_cpu_offload" in l for l in lines)
    assert any("critic.optim.override_optimizer_config.optimizer_cpu_offload=True needs" in l
               and "use_precision_aware_optimizer" in l for l in lines)


def test_model_dependent_checks_use_the_hf_config(four_layers):
    model = str(four_layers)
    pp2 = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"
    config(pp2, OTC + "num_layers_in_first_pipeline_stage=1", OTC + "attention_dropout=0.1", model=model)  # valid
    message = problems(pp2, OTC + "account_for_embedding_in_pipeline_split=true", model=model)
    assert "4 layers + 1 (embedding) + 0 (loss) = 5 do not split evenly" in message
    message = problems(pp2, OTC + "recompute_granularity=full", OTC + "hidden_size=64", model=model)
    assert "recompute_method must be" in message and "megatron-core refuses it" in message
    assert "hidden_size=64: the architecture comes from the HF config" in message and "gives 256" in message
    assert message.count("recompute_method must be") == 1  # the reference inherits the actor's: reported once
    message = problems(pp2, OTC + "account_for_loss_in_pipeline_split=true", OTC + "num_layers_in_first_pipeline_stage=1",
                       model=model)
    assert "cannot be combined" in message
    message = problems(pp2, "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                       OTC + "account_for_loss_in_pipeline_split=true", model=model)
    assert "virtual pipeline" in message


def test_grouped_gemm_experts_are_accepted_and_refused_only_where_the_family_cannot_group(tmp_path):
    """moe_grouped_gemm=True (verl's Qwen3-MoE launches): megatron's grouped experts, read by the bridge per expert
    (megarl.models.grouped_experts); gpt-oss's biased experts cannot be grouped and are refused by name."""
    from megarl.devtools.tiny_model import build_config

    qwen3_moe, gpt_oss = tmp_path / "qwen3_moe", tmp_path / "gpt_oss"
    build_config("qwen3_moe").save_pretrained(qwen3_moe)
    build_config("gpt_oss").save_pretrained(gpt_oss)
    cfg = config(OTC + "moe_grouped_gemm=true", model=str(qwen3_moe))
    assert model_overrides(cfg, "actor")["moe_grouped_gemm"] is True and model_overrides(cfg, "ref")["moe_grouped_gemm"]
    with pytest.raises(ConfigError) as info:
        config(OTC + "moe_grouped_gemm=true", model=str(gpt_oss))
    (refused,) = info.value.refusals
    assert refused.key == "actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm"
    assert "gpt-oss's experts have biases" in refused.message and "leave moe_grouped_gemm unset" in refused.message


def test_offload_checkpoint_and_timeout_keys_are_checked():
    message = problems(OTC + "recompute_method=uniform")
    assert "recompute_method without recompute_granularity recomputes nothing" in message
    message = problems("actor_rollout_ref.ref.megatron.optimizer_offload=true",
                       "actor_rollout_ref.actor.checkpoint.save_contents=[optimizer,weights]",
                       "trainer.max_critic_ckpt_to_keep=-2", "actor_rollout_ref.nccl_timeout=0")
    assert "ref.megatron.optimizer_offload=True: the reference has no gradients or optimizer" in message
    assert "save_contents has unknown entries ['weights']" in message and "lacks 'model'" in message
    assert "trainer.max_critic_ckpt_to_keep=-2" in message and "actor_rollout_ref.nccl_timeout=0" in message
    cfg = config("actor_rollout_ref.actor.megatron.param_offload=true", "trainer.balance_batch=false")
    assert cfg.actor_rollout_ref.ref.megatron.param_offload  # follows the actor's, as in verl
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == ["model", "optimizer", "extra"]


# ------------------------------------------------------------------ balance_batch
def test_balanced_partitions_even_out_tokens_with_equal_sizes():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 1000, (64,), generator=generator)
    lengths[:8] = 2000  # the longest samples all at the start: contiguous shares are very uneven
    parts = balanced_partitions(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(64)) and {len(p) for p in parts} == {16}
    balanced = [int(lengths[p].sum()) for p in parts]
    contiguous = [int(c.sum()) for c in lengths.chunk(4)]
    assert max(balanced) - min(balanced) <= int(lengths.max())  # within one sample of even
    assert max(balanced) - min(balanced) < (max(contiguous) - min(contiguous)) / 10
    assert balanced_partitions([5, 1, 3], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="equal groups"):
        balanced_partitions([1, 2, 3], 2)


def test_balancing_the_step_batch_keeps_groups_and_advantages():
    """The controller's reorder: the same samples, each with its uid and advantage, only moved."""
    from types import SimpleNamespace

    from megarl.trainer.advantage_step import compute_advantages
    from megarl.trainer.controller import RLTrainer
    from megarl.agent.trajectory import Trajectory
    from megarl.trainer.rollout_batch import build_step_data

    cfg = config(validate=False)
    generator = torch.Generator().manual_seed(3)
    trajectories, rows = [], []
    for p in range(4):
        for s in range(4):
            n = int(torch.randint(1, 12, (1,), generator=generator)) * (4 if p == 0 else 1)
            trajectories.append(Trajectory(prompt_ids=[3 + p] * (2 + p), response_ids=list(range(5, 5 + n)),
                                           loss_mask=[1] * n, logprobs=[-0.1] * n, finish_reason="stop",
                                           response_text="x"))
            rows.append(p)
    columns = {"data_source": ["d"] * 4, "ground_truth": ["1"] * 4, "extra_info": [{}] * 4}
    data = build_step_data(columns, trajectories, rows, [f"1:{p}" for p in rows], pad_token_id=0)
    data.add(score=torch.rand(16, generator=generator).tolist())
    trainer = SimpleNamespace(leaders=[0, 1])  # two data-parallel ranks
    metrics = {}
    balanced = RLTrainer._balance(trainer, data, metrics)

    def advantages(d):
        rewards = torch.zeros(d.batch.response_mask.shape)
        rewards[torch.arange(len(d)), d["response_lengths"].clamp(min=1) - 1] = torch.tensor(d["score"])
        adv, _ = compute_advantages(cfg.algorithm, rewards * d.batch.response_mask, d.batch.response_mask, d["uid"])
        return {(u, tuple(ids)): a for u, ids, a in zip(d["uid"], d.batch.input_ids.tolist(), adv[:, 0].tolist())}

    assert advantages(balanced) == advantages(data)  # identical as a set: same (uid, sample) -> same advantage
    tokens = [int(half.sum()) for half in balanced.batch.attention_mask.sum(-1).chunk(2)]
    assert metrics["global_seqlen/balanced_max"] == max(tokens) and metrics["global_seqlen/balanced_min"] == min(tokens)
    assert max(tokens) - min(tokens) < metrics["global_seqlen/minmax_diff"]


# ------------------------------------------------------------------ retention
def test_retention_keeps_the_newest_and_never_the_latest_or_tmp(tmp_path):
    for step in (2, 4, 6, 8, 10):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / "step_12.tmp").mkdir()
    (tmp_path / "latest").write_text("step_4\n")  # e.g. a resume from step 4 that has not saved yet
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step_2", "step_6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_10", "step_12.tmp", "step_4", "step_8"]
    assert prune_checkpoints(tmp_path, keep=None) == [] and prune_checkpoints(tmp_path / "absent", keep=1) == []
    assert [p.name for p in prune_checkpoints(tmp_path, keep=1)] == ["step_8"]
