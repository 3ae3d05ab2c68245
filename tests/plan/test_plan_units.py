"""The planner's pieces on hand-checkable numbers (pure arithmetic)."""

import pytest

from megarl.models.published import PUBLISHED
from megarl.models import ParallelLayout, load_hf_config
from megarl.plan.activations import MicroBatch, Recompute, in_flight
from megarl.plan.buffers import buffer_buckets, slice_numel
from megarl.plan.hardware import Efficiency, efficiency_with, gpu, with_overrides
from megarl.plan.model import ModelFacts, is_ffn_projection, is_routed_expert, megatron_order

FIXTURES = PUBLISHED


def test_ddp_buckets_pad_like_megatron():
    # distributed optimizer: each parameter starts at a multiple of 64 elements, the bucket ends at a multiple
    # of lcm(dp, 128); parameters are laid out in reverse registration order
    [bucket] = buffer_buckets([(100, False), (10, False)], dp=3, distributed=True)
    assert bucket.ranges == ((0, 10), (64, 164)) and bucket.numel == 384
    assert slice_numel([bucket], 3, 0) == (74, 2) and slice_numel([bucket], 3, 1) == (36, 1)
    assert slice_numel([bucket], 3, 2) == (0, 0)
    # the embedding shared across pipeline stages closes the bucket before it and gets its own
    buckets = buffer_buckets([(1000, True), (10, False), (20, False)], dp=2, distributed=True)
    assert [(b.numel, b.ranges) for b in buckets] == [(128, ((0, 20), (64, 74))), (1024, ((0, 1000),))]
    # without the distributed optimizer: no padding at all
    assert [b.numel for b in buffer_buckets([(100, False), (10, False)], dp=3, distributed=False)] == [110]


def test_megatron_order_puts_linear_proj_before_the_input_projections_and_norms_after():
    names = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.linear_proj.weight",
             "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "output_layer.weight", "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    assert sorted(names, key=megatron_order) == [
        "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.weight", "output_layer.weight"]


def test_kv_cache_bytes_per_token():
    llama = ModelFacts(load_hf_config(FIXTURES / "llama-3.1-70b"))
    assert llama.kv_bytes_per_token(8, 2) == 2 * 80 * 1 * 128 * 2  # K and V of 8 KV heads / TP8
    assert llama.kv_bytes_per_token(16, 2) == 2 * 80 * 1 * 128 * 2  # a KV head replicated on 2 ranks
    deepseek = ModelFacts(load_hf_config(FIXTURES / "deepseek-v3"))
    assert deepseek.kv_bytes_per_token(1, 2) == deepseek.kv_bytes_per_token(32, 2) == 61 * (512 + 64) * 2  # MLA latent


def test_vllm_weights_are_the_tp_share_with_padded_vocabulary():
    llama = ModelFacts(load_hf_config(FIXTURES / "llama-3.1-70b"))
    norms = (2 * 80 + 1) * 8192 * 2  # replicated
    vocab_rows = -(-128256 // 64) * 64 // 8
    expected = (llama.hf_params * 2 - norms - 2 * 128256 * 8192 * 2) // 8 + norms + 2 * vocab_rows * 8192 * 2
    assert llama.vllm_weight_bytes(8, 2) == expected


def test_pipeline_in_flight_micro_batches():
    assert in_flight(1, 1, 0, 16) == 1
    assert [in_flight(4, 1, s, 16) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(4, 1, 0, 2) == 2  # fewer micro-batches than stages
    assert in_flight(4, 2, 0, 16) == (4 - 1) * 2 + (2 - 1) * 4 + 1  # megatron's interleaved warm-up + 1


def test_recompute_and_name_helpers():
    assert Recompute.from_overrides({}).describe() == "no recompute"
    with pytest.raises(ValueError, match="recompute_modules \\['attention'\\]"):
        Recompute.from_overrides({"recompute_granularity": "selective", "recompute_modules": ["attention"]})
    assert MicroBatch(2, 64, 40).tokens == 128
    assert is_routed_expert("model.layers.3.mlp.experts.17.down_proj.weight")
    assert not is_routed_expert("model.layers.3.mlp.shared_experts.down_proj.weight")
    assert is_ffn_projection("model.layers.0.mlp.gate_proj.weight") and is_ffn_projection("model.layers.3.mlp.experts.1.up_proj.weight")
    assert not is_ffn_projection("model.layers.3.mlp.shared_experts.up_proj.weight")
    assert not is_ffn_projection("model.layers.3.self_attn.o_proj.weight")


def test_hardware_figures_are_overridable_and_checked():
    h = with_overrides(gpu("H100"), memory_gb=96, ib_gbps=None)
    assert (h.name, h.memory_gb, h.ib_gbps) == ("h100*", 96, 50)
    with pytest.raises(ValueError, match="unknown GPU 'v100'"):
        gpu("v100")
    with pytest.raises(ValueError, match="must be > 0"):
        with_overrides(gpu("a100"), hbm_gbps=0)
    assert efficiency_with(Efficiency(), mfu=0.5).mfu == 0.5
    with pytest.raises(ValueError, match="fraction"):
        efficiency_with(Efficiency(), link=1.5)


def test_layouts_the_model_cannot_take_are_refused_by_name():
    smollm2 = ModelFacts(load_hf_config(FIXTURES / "smollm2-135m"))
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible by tp=2"):
        smollm2.stage_params(ParallelLayout(tp=2), 0)


def test_a_model_path_that_is_not_here_plans_with_the_published_config(capsys):
    """The packaged configs name /models/... paths; on a machine without them the plan reads the
    published config.json of the model they name, and says so; an unknown model is an error."""
    from megarl.models.published import match_published
    from megarl.run.plan_command import main

    assert match_published("/models/Llama-3.1-70B-Instruct").name == "llama-3.1-70b"
    assert match_published("deepseek-ai/DeepSeek-V3").name == "deepseek-v3"
    assert match_published("/home/user/verl/models/Qwen3-235B-A22B").name == "qwen3-235b-a22b"
    assert match_published("/models/Llama-3.1-8B-Instruct") is None
    assert main(["configs/grpo_moe_671b.yaml", "actor_rollout_ref.model.path=/nowhere/DeepSeek-V3"]) == 0
    assert "model: DeepseekV3ForCausalLM, 671.03B parameters" in capsys.readouterr().out
    assert main(["configs/grpo_70b.yaml", "actor_rollout_ref.model.path=/nowhere/Llama-3.1-8B"]) == 2
    assert "not one of the published configs megarl carries" in capsys.readouterr().err
