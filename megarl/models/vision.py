"""What a vision-language family adds to its language model's ``ModelDims``: M-RoPE and the vision tower.

The vision tower is transformers' own module (``Qwen2_5_VisionTransformerPretrainedModel``,
``Qwen3VLVisionModel``) built from ``config.vision_config``: a copy of it would have to follow every
change of its window attention, 2-D RoPE, learned position interpolation and mergers, and it is small
next to the language model, so it is not split over TP (every TP rank of the first pipeline stage
holds all of it and computes every image) and its tensors keep their HF names below ``visual.``.
Its tensor list is read from the module built on the meta device, so the shard layout, loader and
export know it without any weights.

The megatron model that runs it is ``megarl.models.vision_model.VisionLanguageModel``.
"""
from __future__ import annotations

import functools
from dataclasses import replace

from transformers import PretrainedConfig

from megarl.models.dims import ModelDims, Mrope, VisionTower, rope_parameters


def vision_module_class(name: str) -> type:
    import transformers

    return getattr(transformers, name)


@functools.lru_cache(maxsize=16)
def _tensors(module_class: str, vision_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    import torch

    cls = vision_module_class(module_class)
    config = cls.config_class.from_dict(__import__("json").loads(vision_json))
    with torch.device("meta"):
        module = cls._from_config(config)
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def vision_tensors(vision_config: PretrainedConfig, module_class: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of the vision tower (built on the meta device, cached per config)."""
    return _tensors(module_class, vision_config.to_json_string(use_diff=False))


def read_mrope(text_config: PretrainedConfig, head_dim: int) -> Mrope:
    """The language model's M-RoPE sections, refused unless they cover the head's frequencies."""
    _, params = rope_parameters(text_config)
    section = params.get("mrope_section")
    if not section or len(section) != 3 or 2 * sum(section) != head_dim:
        raise ValueError(f"{text_config.model_type}: mrope_section={section} must be 3 frequency counts covering "
                         f"head_dim={head_dim} / 2")
    return Mrope(tuple(int(s) for s in section), bool(params.get("mrope_interleaved", False)))


def vision_language_dims(config: PretrainedConfig, language: ModelDims, *, module_class: str, language_prefix: str,
                         vision_prefix: str, deepstack_layers: int = 0) -> ModelDims:
    """The language model's dims (read from ``config.text_config``) with the model's architecture, the
    checkpoint prefix of its language model, M-RoPE and the vision tower."""
    vision_config = config.vision_config
    if deepstack_layers > language.num_layers:
        raise ValueError(f"{config.model_type}: {deepstack_layers} DeepStack features for {language.num_layers} layers")
    tower = VisionTower(hf_prefix=vision_prefix, module_class=module_class,
                        tensors=vision_tensors(vision_config, module_class), image_token_id=int(config.image_token_id),
                        spatial_merge_size=int(vision_config.spatial_merge_size), deepstack_layers=deepstack_layers)
    architectures = getattr(config, "architectures", None) or [""]
    tied = bool(getattr(config, "tie_word_embeddings", language.tie_word_embeddings))
    return replace(language, architecture=architectures[0], model_type=config.model_type, tie_word_embeddings=tied,
                   hf_prefix=language_prefix, mrope=read_mrope(config.text_config, language.attention.head_dim),
                   vision=tower)
