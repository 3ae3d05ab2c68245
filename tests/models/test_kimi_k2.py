"""The kimi_k2 family without processes: a Kimi-K2-shaped config.json loads unchanged and plans.

Kimi-K2's config.json is DeepSeek-V3's (the published one in ``megarl.models.published``) with
``model_type: kimi_k2`` and Kimi-K2's numbers: 64 heads, 384 experts in one group, the first layer
dense, ``routed_scaling_factor`` 2.827, RoPE base 50000 with YaRN factor 32 and betas 1 / 1, a
163840-token vocabulary and no MTP layer. The HF-logits and export tests live with the other
families (test_bridge_tp1.py, test_bridge_distributed.py).
"""
import json
import math
from collections import defaultdict

from megarl.models import ParallelLayout, family_for, hf_tensor_shapes, load_hf_config, model_dims, param_shards
from megarl.models.published import published_config_dir

KIMI_K2 = dict(model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384, n_group=1,
               topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, rope_theta=50000.0,
               max_position_embeddings=131072, vocab_size=163840, bos_token_id=163584, eos_token_id=163585,
               num_nextn_predict_layers=0, pretraining_tp=1,
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
               rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"})


def kimi_k2_dir(tmp_path):
    fields = json.loads((published_config_dir("deepseek-v3") / "config.json").read_text())
    fields.update(KIMI_K2)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


def test_a_kimi_k2_config_json_loads_unchanged_as_its_own_family(tmp_path):
    config = load_hf_config(kimi_k2_dir(tmp_path))
    assert config.model_type == "kimi_k2" and config.architectures == ["DeepseekV3ForCausalLM"]
    assert family_for(config).name == "kimi_k2"
    dims = model_dims(config)
    assert (dims.moe.num_experts, dims.moe.topk, dims.moe.num_groups, dims.moe.scaling_factor) == (384, 8, None, 2.827)
    assert dims.moe.layers[:2] == (False, True) and dims.attention.num_heads == 64
    assert (dims.rope.theta, dims.rope.factor, dims.rope.beta_fast, dims.rope.beta_slow) == (50000.0, 32.0, 1.0, 1.0)


def test_deepseek_v3_configs_stay_with_their_family():
    config = load_hf_config(published_config_dir("deepseek-v3"))
    assert family_for(config).name == "deepseek_v3"


def test_the_published_size_plans_at_pp16_ep32(tmp_path):
    """Kimi-K2 (1.03T): 61 layers as 4 + 14 x 4 + 1 over PP16, 384 experts as 12 per EP rank."""
    config = load_hf_config(kimi_k2_dir(tmp_path))
    specs = param_shards(config, ParallelLayout(pp=16, ep=32, first_stage_layers=4, last_stage_layers=1))
    experts = defaultdict(set)
    for spec in specs:
        if spec.is_expert and spec.pp_stage == 1:
            experts[spec.ep_rank].add(int(spec.global_name.split(".")[6]))
    assert experts[31] == set(range(372, 384))
    total = sum(math.prod(shape) for shape in hf_tensor_shapes(config).values())
    assert 1.02e12 < total < 1.04e12
