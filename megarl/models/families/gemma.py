"""Gemma-2 (Gemma2ForCausalLM) and Gemma-3 text (Gemma3ForCausalLM): four norms per layer, soft-capping, windows.

What sets them apart from Llama, and where the bridge does it:

* every norm is HF's ``GemmaRMSNorm``: ``x / rms(x) * (1 + weight)`` in fp32
  (``megarl.models.layers.ZeroCenteredRMSNorm``, a zero weight is the identity);
* four norms per layer: ``input_layernorm`` and ``pre_feedforward_layernorm`` before attention and
  MLP as usual, ``post_attention_layernorm`` and ``post_feedforward_layernorm`` on the attention and
  MLP outputs inside the residual branch. megatron's ``TransformerLayer`` has no norm there, so the
  family builds its own layers (``decoder_spec``): the post-norms sit inside the output projections
  (``PostNormRowParallelLinear``: ``self_attention.linear_proj.post_layernorm`` and
  ``mlp.linear_fc2.post_layernorm``);
* GeGLU (``hidden_activation: gelu_pytorch_tanh``: ``gelu(gate, approximate="tanh") * up``);
* the embedding output multiplied by ``sqrt(hidden_size)`` in the model's dtype, tied embeddings;
* attention scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``);
* ``layer_types``: ``sliding_attention`` layers see the ``sliding_window`` keys ending at the query
  (HF's window), ``full_attention`` layers everything; both run megarl's core attention
  (``megarl.models.attention``), with the window and soft-cap per layer;
* Gemma-2: attention logits soft-capped (``attn_logit_softcapping``) and the final logits too
  (``final_logit_softcapping``: ``megarl.models.scaling``, before the vocabulary-padding mask);
* Gemma-3: qk-norm (``q_norm`` / ``k_norm``, Gemma norms over the head dim, before RoPE) and two
  RoPEs (``rope_parameters`` per layer type): the global layers' on the model (default or
  ``linear``-scaled, Gemma-3 4B-27B use factor 8), the sliding layers' own base on their attention
  (``LayerRopeSelfAttention``). Gemma-3's ``attn_logit_softcapping`` is ignored, as transformers
  and vLLM ignore it; its ``final_logit_softcapping`` is applied like Gemma-2's.

The layers are megatron's local modules plus those of ``megarl.models.layers`` under every
``transformer_impl`` (no Transformer Engine module takes a soft-cap or a post-norm), so a Gemma
parameter has one name everywhere. Refused, naming the field: ``attention_bias=True``,
``use_bidirectional_attention``, an unknown ``layer_types`` entry, a scaled sliding-layer RoPE; for
Gemma-2 untied embeddings (vLLM's Gemma-2 always uses the embedding as the output layer).
"""
from __future__ import annotations

from megarl.models.dims import DefaultRope, ModelDims, common_dims, gqa_attention, hf_activation, read_rope
from megarl.models.families.base import FamilySpec, ParamMap, attention_params, gqa_transformer_config
from megarl.models.families.base import same_under_transformer_engine, swiglu_params
from megarl.models.mappings import HFTensor, Replicated

LAYER_TYPES = ("sliding_attention", "full_attention")


def _refuse(config, field: str, value, why: str) -> ValueError:
    return ValueError(f"{config.model_type}: {field}={value!r} is not supported by the megatron bridge: {why}")


def _check(config, untied_ok: bool) -> None:
    if getattr(config, "attention_bias", False):
        raise _refuse(config, "attention_bias", True, "no published Gemma has attention biases (megatron would add "
                      "one to the output projection as well)")
    if getattr(config, "use_bidirectional_attention", False):
        raise _refuse(config, "use_bidirectional_attention", True, "megarl trains causal language models")
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown or len(config.layer_types) != config.num_hidden_layers:
        raise _refuse(config, "layer_types", config.layer_types, f"one of {LAYER_TYPES} per layer is expected")
    if not untied_ok and not config.tie_word_embeddings:
        raise _refuse(config, "tie_word_embeddings", False, "vLLM's Gemma-2 always uses the embedding as its "
                      "output layer, so an untied lm_head would not reach the rollout")


def _windows(config) -> tuple[int | None, ...]:
    return tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)


def _gemma_dims(config, *, qk_norm: bool, softcap, rope, local_rope=None) -> ModelDims:
    attention = gqa_attention(config, qkv_bias=False, qk_norm=qk_norm, softmax_scale=config.query_pre_attn_scalar ** -0.5,
                              softcap=softcap, windows=_windows(config))
    return common_dims(config, attention=attention, rope=rope, local_rope=local_rope,
                       activation=hf_activation(config, "hidden_activation"), embedding_scale=config.hidden_size ** 0.5,
                       final_logit_softcap=config.final_logit_softcapping)


def read_gemma2_dims(config) -> ModelDims:
    _check(config, untied_ok=False)
    return _gemma_dims(config, qk_norm=False, softcap=config.attn_logit_softcapping, rope=read_rope(config, ("default",)))


def read_gemma3_dims(config) -> ModelDims:
    _check(config, untied_ok=True)
    per_type = config.rope_parameters
    rope = read_rope(config, ("default", "linear"), (per_type["full_attention"]["rope_type"], per_type["full_attention"]))
    local = per_type["sliding_attention"]
    if local["rope_type"] != "default":
        raise _refuse(config, "rope_parameters.sliding_attention.rope_type", local["rope_type"],
                      "the sliding-window layers' RoPE is applied unscaled")
    local_rope = DefaultRope(float(local["rope_theta"]))
    uses_local = "sliding_attention" in config.layer_types and local_rope != rope
    return _gemma_dims(config, qk_norm=True, softcap=None, rope=rope, local_rope=local_rope if uses_local else None)


def layer_params(dims: ModelDims, i: int) -> list[ParamMap]:
    """The four norms, attention (qk-norm for Gemma-3) and the GeGLU MLP of layer ``i``, in megatron's order."""
    p = f"model.layers.{i}."
    h = (dims.hidden_size,)

    def norm(megatron: str, hf: str) -> ParamMap:
        return ParamMap(megatron, Replicated(HFTensor(p + hf + ".weight", h)))

    attention = attention_params(dims, i)  # linear_qkv, linear_proj, [q_layernorm, k_layernorm]
    m = p + "mlp."
    mlp = swiglu_params("mlp.", m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight",
                        dims.hidden_size, dims.ffn_hidden_size)
    return ([norm("input_layernorm.weight", "input_layernorm")] + attention[:2]
            + [norm("self_attention.linear_proj.post_layernorm.weight", "post_attention_layernorm")] + attention[2:]
            + [norm("pre_mlp_layernorm.weight", "pre_feedforward_layernorm")] + mlp
            + [norm("mlp.linear_fc2.post_layernorm.weight", "post_feedforward_layernorm")])


def decoder_spec(config, dims: ModelDims, use_transformer_engine: bool) -> tuple[list, type]:
    """One megatron layer spec per decoder layer (see the module docstring) and the final norm."""
    from functools import partial

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megarl.models.attention.core import CoreAttention
    from megarl.models.layers import LayerRopeSelfAttention, PostNormRowParallelLinear, ZeroCenteredRMSNorm

    norm, attention = ZeroCenteredRMSNorm, dims.attention
    post_norm_linear = ModuleSpec(module=PostNormRowParallelLinear, params={"post_norm": norm})
    qk_norm = norm if attention.qk_norm else IdentityOp
    specs = []
    for layer in range(dims.num_layers):
        window = attention.window(layer)
        module, params = SelfAttention, {"attn_mask_type": AttnMaskType.causal}
        if window is not None and dims.local_rope is not None:
            module, params = LayerRopeSelfAttention, {**params, "rotary_base": dims.local_rope.theta}
        self_attention = ModuleSpec(module=module, params=params, submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, core_attention=partial(CoreAttention, window=window, softcap=attention.softcap),
            linear_proj=post_norm_linear, q_layernorm=qk_norm, k_layernorm=qk_norm))
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=post_norm_linear))
        specs.append(ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=self_attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add)))
    return specs, norm


# ---------------------------------------------------------------- tiny models (megarl.devtools.tiny_model)

# Soft-caps and windows small enough to act on a tiny random model: its attention scores reach about
# 0.24 and its logits about 1.0 (measured on the tiny seed-0 Gemma-2), so caps of 0.2 and 0.6 clip;
# sequences of 16 or more tokens outrun a window of 5.
TINY = dict(sliding_window=5, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")


def _tiny_fields(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k not in ("hidden_act", "rope_parameters", "tie_word_embeddings")}


def _tiny_layer_types(layers: int, sliding_every: int) -> list[str]:
    return ["full_attention" if (i + 1) % sliding_every == 0 else "sliding_attention" for i in range(layers)]


def tiny_gemma2(fields: dict, size: str):
    from transformers import Gemma2Config

    return Gemma2Config(**_tiny_fields(fields), **TINY, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        layer_types=_tiny_layer_types(fields["num_hidden_layers"], 2),
                        attn_logit_softcapping=0.2, final_logit_softcapping=0.6)


def tiny_gemma3(fields: dict, size: str):
    """Gemma-3 text with a linear-scaled global RoPE (factor 8, as Gemma-3 4B-27B) and a 3:1 layer pattern."""
    from transformers import Gemma3TextConfig

    layers = fields["num_hidden_layers"]
    return Gemma3TextConfig(**_tiny_fields(fields), **TINY, tie_word_embeddings=True,
                            rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                            layer_types=_tiny_layer_types(layers, 2 if layers < 4 else 4))


_COMMON = dict(layer_params=layer_params, transformer_config=gqa_transformer_config, decoder_spec=decoder_spec,
               transformer_engine=same_under_transformer_engine, tiny_chat_format="gemma")

GEMMA2 = FamilySpec(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    description="Gemma-2: 4 zero-centred norms per layer, GeGLU, soft-capped attention and logits, sliding windows",
    read_dims=read_gemma2_dims,
    tiny_config=tiny_gemma2,
    **_COMMON,
)

GEMMA3 = FamilySpec(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    description="Gemma-3 text: Gemma-2's layers with qk-norm, a local and a global RoPE, no attention soft-cap",
    read_dims=read_gemma3_dims,
    tiny_config=tiny_gemma3,
    **_COMMON,
)
