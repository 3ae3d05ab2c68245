"""The facts about a Hugging Face model config that the bridge needs, read once and checked.

``ModelDims`` is what every decoder-only family shares (vocabulary, width, depth, norms, the
dense MLP) plus three typed blocks that families fill in their own way:

* ``attention``: ``GQAttention`` (Llama, Qwen, Mixtral: grouped-query heads, optional QKV bias and
  qk-norm; Gemma: a softmax scale of its own, logit soft-capping, sliding windows per layer) or
  ``MLAttention`` (DeepSeek-V3: multi-latent attention, low-rank q/kv projections);
* ``rope``: ``DefaultRope``, ``LinearRope`` (Gemma-3's global layers), ``Llama3Rope`` (any
  original context and low/high factors) or ``YarnRope`` (DeepSeek-V3, with mscale);
* ``moe``: ``MoE`` or None for a dense model (softmax or sigmoid routing, expert groups, the
  routed scaling factor, the expert-bias buffer, shared experts).

The readers here hide the differences between config classes and transformers versions
(transformers 5 keeps RoPE in ``config.rope_parameters``, 4.x in ``rope_theta``/``rope_scaling``;
Mixtral's ``head_dim`` may be None). Features no family has read (a sliding window, an
activation other than SiLU, unknown RoPE types) are rejected here with an error that says what
to change; a family that reads them (Gemma) says so through the dims it builds.

``load_hf_config`` reads a config.json through transformers' ``AutoConfig``, after the families
registered the config classes of model types transformers does not know (Kimi-K2's ``kimi_k2``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig


@dataclass(frozen=True)
class GQAttention:
    """Grouped-query self-attention: q/k/v projections fused per query group in megatron."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    qkv_bias: bool
    qk_norm: bool
    softmax_scale: float | None = None  # None: 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar ** -0.5
    softcap: float | None = None  # attention logits become softcap * tanh(logits / softcap) (Gemma-2)
    windows: tuple[int | None, ...] = ()  # per layer: HF's sliding_window (keys ending at the query), None = full

    def window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (0-based), or None for full attention."""
        return self.windows[layer] if self.windows else None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    def tp_problems(self, tp: int) -> list[str]:
        return [f"{what}={size} is not divisible by tp={tp}"
                for what, size in (("num_attention_heads", self.num_heads),
                                   ("num_key_value_heads (query groups)", self.num_query_groups)) if size % tp]


@dataclass(frozen=True)
class MLAttention:
    """Multi-latent attention (DeepSeek-V2/V3): q (optionally low-rank) and a shared kv latent.

    HF names: ``q_a_proj`` [q_lora_rank, hidden] -> ``q_a_layernorm`` -> ``q_b_proj``
    [heads * (nope + rope), q_lora_rank] (or ``q_proj`` without a q latent);
    ``kv_a_proj_with_mqa`` [kv_lora_rank + rope, hidden] -> ``kv_a_layernorm`` (latent part) ->
    ``kv_b_proj`` [heads * (nope + v), kv_lora_rank]; ``o_proj`` [hidden, heads * v].
    """

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def tp_problems(self, tp: int) -> list[str]:
        return [f"num_attention_heads={self.num_heads} is not divisible by tp={tp}"] if self.num_heads % tp else []


@dataclass(frozen=True)
class DefaultRope:
    theta: float


@dataclass(frozen=True)
class LinearRope:
    """Linear position interpolation (HF ``rope_type: linear``): the default frequencies divided by ``factor``."""

    theta: float
    factor: float


@dataclass(frozen=True)
class Llama3Rope:
    """Llama-3.1 frequency scaling; every parameter is honoured (megatron-core's own fixes 1/4/8192)."""

    theta: float
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnRope:
    """YaRN (DeepSeek-V3): interpolated frequencies, cos/sin and softmax scaled by mscale factors."""

    theta: float
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float  # megatron's meaning: the cos/sin factor is mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float


@dataclass(frozen=True)
class TransformersRope:
    """A RoPE whose inverse frequencies transformers computes for the config (``ROPE_INIT_FUNCTIONS[rope_type]``),
    set on megatron's rotary embedding after the build; transformers' ``attention_factor`` on cos and sin
    scales q and k alike, so it is folded into the softmax scale (times its square). gpt-oss's YaRN with
    ``truncate: false``, which megatron's ``YarnRotaryEmbedding`` (always truncating) cannot build."""

    theta: float
    rope_type: str
    attention_factor: float


Rope = DefaultRope | LinearRope | Llama3Rope | YarnRope | TransformersRope


@dataclass(frozen=True)
class MoE:
    """The routed-expert MLP of the MoE layers.

    Routing: ``score_function`` (softmax or sigmoid) over ``num_experts``; optionally only the
    ``group_topk`` best of ``num_groups`` expert groups compete; top-``topk``; renormalised when
    ``norm_topk_prob``; multiplied by ``scaling_factor``. ``expert_bias``: a per-expert fp32 bias
    added for the choice only (DeepSeek-V3's ``e_score_correction_bias``), a buffer that megatron
    updates every step. ``shared_expert_ffn_hidden_size``: an always-on SwiGLU MLP next to the experts.
    """

    num_experts: int
    ffn_hidden_size: int
    topk: int
    layers: tuple[bool, ...]  # per decoder layer: True where the MLP is a MoE block
    norm_topk_prob: bool = True
    score_function: str = "softmax"
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    expert_bias: bool = False
    shared_expert_ffn_hidden_size: int = 0


@dataclass(frozen=True)
class Mrope:
    """Multimodal RoPE (``megarl.models.mrope``): the rotary frequencies of time, height and width, in
    blocks (Qwen2.5-VL) or interleaved (Qwen3-VL)."""

    section: tuple[int, int, int]
    interleaved: bool


@dataclass(frozen=True)
class VisionTower:
    """A vision-language model's vision tower (``megarl.models.vision``): transformers' own module
    ``module_class``, built from ``config.vision_config``; its tensors ``tensors`` (name -> shape, relative
    to ``hf_prefix`` in the checkpoint and to ``visual.`` in the megatron model), replicated on every TP
    rank of the first pipeline stage. Its features replace the embeddings of the ``image_token_id``
    tokens; ``deepstack_layers``: Qwen3-VL adds its DeepStack features after that many first layers."""

    hf_prefix: str
    module_class: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    image_token_id: int
    spatial_merge_size: int
    deepstack_layers: int = 0


@dataclass(frozen=True)
class ModelDims:
    """Shape and features of a decoder-only transformer, independent of the HF config class."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    ffn_hidden_size: int  # the dense MLP (every layer of a dense model, the dense layers of a MoE model)
    norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention: GQAttention | MLAttention
    rope: Rope
    moe: MoE | None = None
    # What a family may change in the layers every family shares (defaults: Llama's):
    activation: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    rotary_percent: float = 1.0  # the share of each head's channels RoPE rotates (GLM-4.5: 0.5)
    local_rope: Rope | None = None  # the RoPE of the sliding-window layers, where it differs (Gemma-3)
    embedding_scale: float | None = None  # the embedding output is multiplied by it (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits become cap * tanh(logits / cap) (Gemma-2)
    clamped_swiglu: tuple[float, float] | None = None  # gpt-oss's (limit, alpha): see families/gpt_oss.py
    # Vision-language models: the language model's checkpoint prefix (``model.language_model.`` for Qwen3-VL;
    # every HF name the family's maps give under ``model.`` moves there), M-RoPE, the vision tower.
    hf_prefix: str = "model."
    mrope: Mrope | None = None
    vision: VisionTower | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]

    @property
    def has_dense_layers(self) -> bool:
        return self.moe is None or not all(self.moe.layers)

    def kv_bytes_per_token(self, rollout_tp: int, itemsize: int) -> int:
        """KV-cache bytes per token on one vLLM worker, every layer counted as full attention (an upper
        bound for sliding-window and linear-attention layers): K and V of its KV heads (a head is replicated
        when TP exceeds the KV heads); MLA keeps one compressed latent (kv_lora_rank + qk_rope_head_dim)
        per token and layer on every TP rank."""
        attention, layers = self.attention, self.num_layers
        if isinstance(attention, MLAttention):
            return layers * (attention.kv_lora_rank + attention.qk_rope_head_dim) * itemsize
        heads = max(1, attention.num_query_groups // rollout_tp)
        return 2 * layers * heads * attention.head_dim * itemsize


def load_hf_config(hf_config_or_dir: PretrainedConfig | str | os.PathLike) -> PretrainedConfig:
    """A transformers config from a config object, a model directory or a config.json path."""
    if isinstance(hf_config_or_dir, PretrainedConfig):
        return hf_config_or_dir
    from megarl.models.families import register_checkpoint_classes

    path = Path(hf_config_or_dir)
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a Hugging Face model directory or config")
    register_checkpoint_classes(path)
    return AutoConfig.from_pretrained(str(path))


def rope_parameters(config: PretrainedConfig) -> tuple[str, dict]:
    """(rope type, parameters incl. ``rope_theta``) from transformers 5 or 4.x config fields."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = dict(params)
    else:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return scaling.get("rope_type", scaling.get("type", "default")), scaling


def read_rope(config: PretrainedConfig, supported: tuple[str, ...] = ("default", "llama3"),
              parameters: tuple[str, dict] | None = None) -> Rope:
    """The config's RoPE (or ``parameters``: one layer type's ``(type, parameters)``), if the family supports its type."""
    rope_type, p = parameters or rope_parameters(config)
    theta = float(p["rope_theta"])
    if rope_type not in supported:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported by the megatron bridge for {config.model_type} "
            f"(supported: {', '.join(supported)}); use a model without that RoPE scaling"
        )
    if rope_type == "default":
        return DefaultRope(theta)
    if rope_type == "linear":
        return LinearRope(theta, float(p["factor"]))
    if rope_type == "llama3":
        return Llama3Rope(theta, float(p["factor"]), float(p.get("low_freq_factor", 1.0)),
                          float(p.get("high_freq_factor", 4.0)), int(p.get("original_max_position_embeddings", 8192)))
    return _read_yarn(config, theta, p)


def _read_yarn(config: PretrainedConfig, theta: float, p: dict) -> YarnRope:
    """YaRN as transformers computes it, in megatron-core's ``YarnRotaryEmbedding`` terms."""
    original = int(p["original_max_position_embeddings"])
    factor = p.get("factor") or config.max_position_embeddings / original
    if p.get("truncate", True) is False:
        raise ValueError(f"{config.model_type}: YaRN with rope_parameters.truncate=False is not supported "
                         "(megatron-core always truncates the correction range); use truncate=true")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    # transformers uses mscale only together with mscale_all_dim (else the cos/sin factor is mscale(factor, 1)).
    megatron_mscale = float(mscale) if mscale and mscale_all_dim else 1.0
    rope = YarnRope(theta, float(factor), original, float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1),
                    megatron_mscale, float(mscale_all_dim or 0.0))
    if p.get("attention_factor") is not None and abs(float(p["attention_factor"]) - yarn_attention_factor(rope)) > 1e-12:
        raise ValueError(f"{config.model_type}: YaRN rope_parameters.attention_factor={p['attention_factor']} differs "
                         f"from the value its mscale fields give ({yarn_attention_factor(rope)}); megatron-core derives "
                         "it from mscale/mscale_all_dim only: remove attention_factor")
    return rope


def _yarn_mscale(scale: float, mscale: float) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rope: YarnRope) -> float:
    """The factor on cos/sin (megatron-core's and transformers' formula)."""
    return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)


# HF activation names -> ``ModelDims.activation``
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def hf_activation(config: PretrainedConfig, field: str = "hidden_act") -> str:
    """``ModelDims.activation`` of the HF config's ``field``, refused when the bridge has no such MLP."""
    value = getattr(config, field, None) or "silu"
    if value not in HF_ACTIVATIONS:
        raise ValueError(f"{field}={value!r}: the bridge's gated MLPs use {sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[value]


def check_common(config: PretrainedConfig, attention=None, activation: str | None = None) -> None:
    """Reject features the family did not read: an activation other than SiLU unless the family
    gave one (``activation``), a sliding window unless its attention holds the windows."""
    if activation is None and getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: only SwiGLU (silu) MLPs are supported")
    if _uses_sliding_window(config) and not getattr(attention, "windows", ()):
        raise ValueError(
            f"sliding-window attention (sliding_window={config.sliding_window}) is not supported by the "
            "bridge; set use_sliding_window=false / sliding_window=null if the model does not need it"
        )
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by the bridge (no family uses it)")


def common_dims(config: PretrainedConfig, *, attention, rope: Rope, moe: MoE | None = None, ffn_hidden_size: int | None = None,
                **features) -> ModelDims:
    """ModelDims from the fields every family shares plus the family's attention, RoPE and MoE blocks;
    ``features``: the other ``ModelDims`` fields the family sets (activation, embedding scale...);
    ``ffn_hidden_size``: the dense MLP's width where the config has no ``intermediate_size`` (Qwen3.5-MoE)."""
    check_common(config, attention, features.get("activation"))
    architectures = getattr(config, "architectures", None) or [""]
    return ModelDims(
        architecture=architectures[0],
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        ffn_hidden_size=ffn_hidden_size or config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        attention=attention,
        rope=rope,
        moe=moe,
        **features,
    )


def gqa_attention(config: PretrainedConfig, *, qkv_bias: bool, qk_norm: bool, **features) -> GQAttention:
    """GQA from the config's head counts; ``features``: the other ``GQAttention`` fields (scale, softcap, windows)."""
    heads = config.num_attention_heads
    return GQAttention(
        num_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        **features,
    )


def _uses_sliding_window(config: PretrainedConfig) -> bool:
    """Qwen configs switch the window with ``use_sliding_window``; Mixtral's is on when set."""
    if hasattr(config, "use_sliding_window"):
        return bool(config.use_sliding_window)
    return getattr(config, "sliding_window", None) is not None
