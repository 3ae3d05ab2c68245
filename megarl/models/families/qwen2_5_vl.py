"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a Qwen2.5 language model with M-RoPE and a vision tower.

The language model is the ``qwen2`` family's (QKV bias) with multimodal RoPE in blocks
(``megarl.models.mrope``); the vision tower (windowed ViT, 2x2 patch merger) is transformers' own
module, replicated on the first pipeline stage (``megarl.models.vision``). The checkpoints keep the
names Qwen published: the language model under ``model.`` (as a Qwen2 text checkpoint), the tower
under ``visual.``, and transformers 5 writes them so.
"""
from dataclasses import replace

from megarl.models.families import qwen2
from megarl.models.vision import vision_language_dims

VISION_CLASS = "Qwen2_5_VisionTransformerPretrainedModel"


def read_dims(config):
    return vision_language_dims(config, qwen2.read_dims(config.text_config), module_class=VISION_CLASS,
                                language_prefix="model.", vision_prefix="visual.")


SPEC = replace(
    qwen2.SPEC,
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    model_types=("qwen2_5_vl",),
    description="Qwen2.5-VL: Qwen2.5 with M-RoPE and transformers' vision tower (replicated, first stage)",
    read_dims=read_dims,
)
