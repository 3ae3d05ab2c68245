"""The facts about a Hugging Face model config that the bridge needs, read once and checked.

``ModelDims`` hides the differences between config classes and transformers versions:
transformers 5 keeps the RoPE base in ``config.rope_parameters`` (4.x: ``config.rope_theta`` and
``config.rope_scaling``); Mixtral's ``head_dim`` may be None; MoE configs name the expert count
``num_local_experts`` (Mixtral) or ``num_experts`` (Qwen3-MoE). Features the megatron-core local
spec cannot reproduce exactly (sliding-window attention, unknown RoPE scaling, non-SiLU
activations) are rejected here with an error that says what to change.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

# Megatron's built-in Llama-3 RoPE scaling hard-codes these (rotary_pos_embedding._apply_scaling).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelDims:
    """Shape and features of a decoder-only transformer, independent of the HF config class."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_llama3_factor: float | None  # Llama-3.1 style RoPE scaling factor, None when unscaled
    max_position_embeddings: int
    num_experts: int = 0  # 0 for dense models
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    moe_layers: tuple[bool, ...] = ()  # per decoder layer: True where the MLP is a MoE block
    moe_norm_topk_prob: bool = True  # renormalise the top-k routing probabilities (Mixtral always does)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]


def load_hf_config(hf_config_or_dir: PretrainedConfig | str | os.PathLike) -> PretrainedConfig:
    """A transformers config from a config object, a model directory or a config.json path."""
    if isinstance(hf_config_or_dir, PretrainedConfig):
        return hf_config_or_dir
    path = Path(hf_config_or_dir)
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a Hugging Face model directory or config")
    return AutoConfig.from_pretrained(str(path))


def rope_settings(config: PretrainedConfig) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None), from transformers 5 or 4.x config fields."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = getattr(config, "rope_theta", 10000.0), getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        for key, expected in _MEGATRON_LLAMA3_ROPE.items():
            if float(scaling.get(key, expected)) != expected:
                raise ValueError(
                    f"llama3 RoPE scaling with {key}={scaling[key]} is not reproducible: megatron-core's "
                    f"rope_scaling fixes it to {expected}"
                )
        return float(theta), float(scaling["factor"])
    raise ValueError(
        f"RoPE type {rope_type!r} is not supported by the megatron bridge (supported: default, llama3); "
        "use a model without that RoPE scaling"
    )


def common_dims(config: PretrainedConfig, *, qkv_bias: bool, qk_norm: bool, **moe) -> ModelDims:
    """ModelDims of a Llama-like config; families pass their own bias/norm/MoE facts."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: only SwiGLU (silu) MLPs are supported")
    if _uses_sliding_window(config):
        raise ValueError(
            f"sliding-window attention (sliding_window={config.sliding_window}) is not supported by the "
            "bridge; set use_sliding_window=false / sliding_window=null if the model does not need it"
        )
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by the bridge (no family uses it)")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta, llama3_factor = rope_settings(config)
    architectures = getattr(config, "architectures", None) or [""]
    return ModelDims(
        architecture=architectures[0],
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn_hidden_size=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        rope_theta=theta,
        rope_llama3_factor=llama3_factor,
        max_position_embeddings=config.max_position_embeddings,
        **moe,
    )


def _uses_sliding_window(config: PretrainedConfig) -> bool:
    """Qwen configs switch the window with ``use_sliding_window``; Mixtral's is on when set."""
    if hasattr(config, "use_sliding_window"):
        return bool(config.use_sliding_window)
    return getattr(config, "sliding_window", None) is not None
