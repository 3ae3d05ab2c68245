"""Build megatron-core GPTModels from a Hugging Face config or checkpoint directory.

``build_model`` makes one GPTModel per virtual pipeline chunk of this rank, with the local layer
spec (Transformer Engine's where TE imports and CUDA is present) or the family's own
(``FamilySpec.decoder_spec``: each chunk keeps its own layers of it), at the TP/PP/SP/EP/VPP of a
``ParallelLayout`` that must match megatron's initialised parallel state
(``megarl.platform.init_distributed`` + ``initialize_model_parallel``). Given a checkpoint
directory it loads the weights shard by shard (``megarl.models.loading``). The local spec's core
attention is megarl's (``megarl.models.attention``: packed sequences, context parallelism); under
Transformer Engine it is TE's.

Roles: ``actor`` and ``ref`` are the causal LM (``ref`` frozen, in eval mode); ``critic`` swaps the
LM head for a scalar ``ValueHead`` and returns values [batch, seq, 1].

After the build: a vocabulary padded for TP gets zero padding rows and masked padding logits
(``megarl.models.vocab_padding``); Llama-3 and linear RoPE get transformers' exact inverse
frequencies (megatron-core's own llama3 scaling fixes low/high factors and the original context to
1/4/8192); an embedding scale and final-logit soft-capping the family states in its ``ModelDims``
become forward hooks (``megarl.models.scaling``), the soft-capping before the padding mask.

Model transforms (``transforms=[...]``, torchtitan's "model converters"): callables
``transform(chunks, BuildContext)`` applied in order once the model is built and its weights are
loaded (before the reference is frozen), e.g. ``megarl.models.lora.LoRATransform``. A transform
may add parameters, but the bridge's own parameters keep their names and shapes, so loading,
export, the shard layout and the weight sync are unchanged by it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import PretrainedConfig

from megarl.models.config import build_transformer_config, gpt_model_kwargs, transformer_config_kwargs
from megarl.models.config_overrides import apply_overrides
from megarl.models.dims import LinearRope, Llama3Rope, ModelDims, TransformersRope, load_hf_config
from megarl.models.families import family_for
from megarl.models.grouped_experts import grouped_gemm_problem
from megarl.models.layout import ParallelLayout
from megarl.models.shards import ROLES, check_layout
from megarl.models.value_head import ValueHead


@dataclass(frozen=True)
class BuildContext:
    """What a model transform is told about the model it transforms."""

    hf_config: PretrainedConfig
    layout: ParallelLayout
    role: str
    transformer_impl: str


ModelTransform = Callable[[list, BuildContext], None]


def default_transformer_impl() -> str:
    """``transformer_engine`` where TE imports and CUDA is available, else ``local``."""
    from megarl.platform import has_cuda

    if not has_cuda():
        return "local"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "local"
    return "transformer_engine"


def check_parallel_state(layout: ParallelLayout, is_moe: bool) -> None:
    """Raise when megatron's parallel state is missing or disagrees with ``layout``."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron parallel state is not initialised; call megarl.platform.init_distributed() and "
            "megarl.platform.initialize_model_parallel(tp=..., pp=..., cp=..., ep=..., etp=..., vpp=...) first"
        )
    actual = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "cp": ps.get_context_parallel_world_size(),
    }
    if is_moe:
        actual["ep"] = ps.get_expert_model_parallel_world_size()
        actual["etp"] = ps.get_expert_tensor_parallel_world_size()
    wrong = {name: size for name, size in actual.items() if getattr(layout, name) != size}
    if wrong:
        raise ValueError(
            f"layout {layout} disagrees with megatron's parallel state ({', '.join(f'{k}={v}' for k, v in wrong.items())}); "
            "initialise model parallelism with the layout's sizes"
        )


def build_model(
    hf_config_or_dir: PretrainedConfig | str | os.PathLike,
    layout: ParallelLayout,
    role: str = "actor",
    *,
    load_weights: bool = True,
    params_dtype: torch.dtype | None = None,
    transformer_impl: str | None = None,
    moe_token_dispatcher: str = "alltoall",
    config_overrides: dict | None = None,
    value_head_seed: int = 0,
    transforms: Sequence[ModelTransform] = (),
    hf_overrides: dict | None = None,
    freeze_vision_tower: bool = False,
) -> list:
    """This rank's GPTModel chunks (one per VPP chunk, in chunk order).

    ``hf_config_or_dir``: an HF config (random init) or a model directory; with a directory and
    ``load_weights`` the weights are read from its safetensors (weight init is skipped). A critic
    built from a causal-LM checkpoint keeps its freshly initialised value head.
    ``params_dtype`` defaults to the platform's (bf16 on GPU, fp32 on CPU). ``config_overrides``
    are TransformerConfig fields applied last (e.g. ``recompute_granularity``). ``transforms``
    run last, in order, on the loaded chunks (see the module docstring). ``hf_overrides`` are HF config
    fields set before the bridge reads the config (verl's ``override_config.model_config``;
    ``megarl.models.config_overrides``). A vision-language model is a ``VisionLanguageModel``
    (``megarl.models.vision_model``); ``freeze_vision_tower`` stops its tower's gradients.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

    from megarl.models.loading import load_hf_weights, zero_vocab_padding
    from megarl.models.scaling import scale_embedding, softcap_logits
    from megarl.models.vocab_padding import mask_padding_logits
    from megarl.platform import default_dtype, device, ensure_platform, has_cuda, transformer_config_overrides

    if role not in ROLES:
        raise ValueError(f"role={role!r}; expected one of {ROLES}")
    ensure_platform()  # the CPU compatibility layer (a no-op with CUDA)
    config = apply_overrides(load_hf_config(hf_config_or_dir), hf_overrides)
    family = family_for(config)
    dims = family.read_dims(config)
    check_layout(dims, layout)
    check_parallel_state(layout, dims.is_moe)
    checkpoint = None
    if load_weights and not isinstance(hf_config_or_dir, PretrainedConfig):
        checkpoint = Path(hf_config_or_dir)
        checkpoint = checkpoint.parent if checkpoint.is_file() else checkpoint
    impl = transformer_impl or default_transformer_impl()
    params_dtype = params_dtype or default_dtype()

    kwargs = transformer_config_kwargs(
        dims, family, layout, params_dtype, moe_token_dispatcher, getattr(config, "initializer_range", 0.02)
    )
    overrides = {"perform_initialization": checkpoint is None, **(config_overrides or {})}
    if dims.vision is not None and dims.vision.deepstack_layers and overrides.get("recompute_granularity") == "full":
        raise ValueError(f"{dims.architecture}: full activation recomputation is not supported with DeepStack features "
                         "(a pipeline schedule would recompute a layer with another micro-batch's features); use "
                         "recompute_granularity=selective or none")
    transformer_config = build_transformer_config(kwargs, transformer_config_overrides(), overrides, family.config_class)
    if dims.is_moe and transformer_config.moe_grouped_gemm:
        uses_te_spec = impl == "transformer_engine" and family.decoder_spec is None
        problem = grouped_gemm_problem(family, uses_te_spec, has_cuda())
        if problem is not None:
            raise ValueError(f"{family.name}: {problem}")

    pp_rank = ps.get_pipeline_model_parallel_rank()
    models = []
    for vpp_chunk in range(layout.vpp):
        spec = decoder_block_spec(family, dims, transformer_config, impl, vpp_chunk, pp_rank)
        pre, post = layout.is_first_chunk(pp_rank, vpp_chunk), layout.is_last_chunk(pp_rank, vpp_chunk)
        model_class, extra = GPTModel, {}
        if dims.vision is not None:
            from megarl.models.vision_model import VisionLanguageModel

            model_class, extra = VisionLanguageModel, dict(dims=dims, vision_config=config.vision_config)
        model = model_class(
            transformer_config,
            spec,
            pre_process=pre,
            post_process=post,
            vp_stage=vpp_chunk if layout.vpp > 1 else None,
            **gpt_model_kwargs(dims, layout, role),
            **extra,
        )
        if isinstance(dims.rope, (Llama3Rope, LinearRope, TransformersRope)):
            model.rotary_pos_emb.inv_freq = rope_inverse_frequencies(config, dims, model.rotary_pos_emb.inv_freq)
        if dims.embedding_scale is not None and pre:
            scale_embedding(model, dims.embedding_scale)
        if role == "critic" and post:
            model.output_layer = ValueHead(
                dims.hidden_size,
                layout.sequence_parallel,
                params_dtype,
                device(),
                transformer_config.init_method_std,
                value_head_seed,
            )
        for param in model.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        models.append(model)

    if checkpoint is not None:
        load_hf_weights(models, checkpoint, layout, role, impl)
    else:
        zero_vocab_padding(models, config, layout, role, impl)
    if role != "critic":
        if dims.final_logit_softcap is not None:
            softcap_logits(models, dims.final_logit_softcap)
        mask_padding_logits(models, dims.vocab_size, layout)
    if freeze_vision_tower:
        from megarl.models.vision_model import freeze_vision_tower as freeze

        freeze(models)
    context = BuildContext(config, layout, role, impl)
    for transform in transforms:
        transform(models, context)
    if role == "ref":
        for model in models:
            model.requires_grad_(False)
            model.eval()
    return models


def decoder_block_spec(family, dims: ModelDims, transformer_config, impl: str, vpp_chunk: int, pp_rank: int):
    """The decoder layers of one model chunk: the family's own (``FamilySpec.decoder_spec``), else
    megatron's GPT spec with the family's fixes and, on the local spec, megarl's core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.models.attention import use_core_attention

    use_te = impl == "transformer_engine"
    if family.decoder_spec is not None:
        layer_specs, final_norm = family.decoder_spec(transformer_config, dims, use_te)
        offset = get_transformer_layer_offset(transformer_config, vp_stage=vpp_chunk, pp_rank=pp_rank)
        count = get_num_layers_to_build(transformer_config, vp_stage=vpp_chunk, pp_rank=pp_rank)
        return TransformerBlockSubmodules(layer_specs=layer_specs[offset : offset + count], layer_norm=final_norm)
    spec = get_gpt_decoder_block_spec(transformer_config, use_transformer_engine=use_te, normalization="RMSNorm",
                                      vp_stage=vpp_chunk, pp_rank=pp_rank)
    for layer_spec in spec.layer_specs:
        family.prepare_layer_spec(layer_spec)
        if not use_te:
            use_core_attention(layer_spec)
    return spec


def rope_inverse_frequencies(hf_config: PretrainedConfig, dims: ModelDims, unscaled: torch.Tensor) -> torch.Tensor:
    """transformers' inverse frequencies of a scaled RoPE, from megatron's unscaled ones (same formula)."""
    if isinstance(dims.rope, LinearRope):
        return unscaled / dims.rope.factor  # transformers' linear scaling: the default frequencies / factor
    if isinstance(dims.rope, TransformersRope):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, _ = ROPE_INIT_FUNCTIONS[dims.rope.rope_type](hf_config, "cpu")
        return inv_freq.float().to(unscaled.device)
    return llama3_inverse_frequencies(hf_config)


def llama3_inverse_frequencies(hf_config: PretrainedConfig) -> torch.Tensor:
    """transformers' own Llama-3 RoPE inverse frequencies for this config (any low/high factors and context)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    return inv_freq.float()
