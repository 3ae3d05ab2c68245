"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): a Qwen3 language model with interleaved M-RoPE, a vision
tower and DeepStack.

The language model is the ``qwen3`` family's (qk-norm) with multimodal RoPE whose time, height and width
frequencies interleave (``megarl.models.mrope``); the vision tower (ViT with learned and 2-D RoPE
positions) is transformers' own module, replicated on the first pipeline stage
(``megarl.models.vision``). Its DeepStack mergers turn the outputs of some vision blocks
(``deepstack_visual_indexes``) into features that are added, at the image tokens, to the hidden states
after the first as many decoder layers; those layers must sit on the first pipeline stage. Checkpoints
hold the language model under ``model.language_model.``, the tower under ``model.visual.``.
"""
from dataclasses import replace

from megarl.models.families import qwen3
from megarl.models.vision import vision_language_dims

VISION_CLASS = "Qwen3VLVisionModel"


def vision_language(config, language, vision_class: str = VISION_CLASS):
    """The language model's dims ``language`` with Qwen3-VL's tower (``vision_class``), DeepStack, M-RoPE and
    checkpoint prefixes (Qwen3-VL-MoE's too)."""
    deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
    return vision_language_dims(config, language, module_class=vision_class, language_prefix="model.language_model.",
                                vision_prefix="model.visual.", deepstack_layers=deepstack)


def read_dims(config):
    return vision_language(config, qwen3.read_dims(config.text_config))


SPEC = replace(
    qwen3.SPEC,
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    model_types=("qwen3_vl",),
    description="Qwen3-VL: Qwen3 with interleaved M-RoPE, transformers' vision tower and DeepStack features",
    read_dims=read_dims,
)
