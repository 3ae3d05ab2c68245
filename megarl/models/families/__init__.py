"""The registry of model families, keyed by HF architecture name.

Adding a family is one new module in this package defining a ``FamilySpec`` (see ``base``: its
dims, parameter maps, megatron config fields, Transformer Engine names and vLLM exceptions) and
one entry in ``_BUILTIN`` below, or a ``register_family`` call from outside.

Several families may serve one architecture under different model types (Kimi-K2 is
``DeepseekV3ForCausalLM`` with ``model_type: kimi_k2``): a config goes to the family of its
model type when that family serves its architecture, else to the architecture's first family.
"""
from __future__ import annotations

from transformers import PretrainedConfig

from megarl.models.families import (deepseek_v3, gemma, glm4_moe, gpt_oss, kimi_k2, llama, mixtral, qwen2, qwen2_5_vl, qwen3,
                                     qwen3_5, qwen3_moe, qwen3_next, qwen3_vl, qwen3_vl_moe)
from megarl.models.families.base import FamilySpec, ParamMap

_BUILTIN = (llama.SPEC, qwen2.SPEC, qwen3.SPEC, qwen3_moe.SPEC, mixtral.SPEC, deepseek_v3.SPEC, gemma.GEMMA2, gemma.GEMMA3,
            glm4_moe.SPEC, kimi_k2.SPEC, gpt_oss.SPEC, qwen3_next.SPEC, qwen3_5.SPEC, qwen3_5.MOE_SPEC,
            qwen2_5_vl.SPEC, qwen3_vl.SPEC, qwen3_vl_moe.SPEC)

FAMILIES: dict[str, FamilySpec] = {}
_BY_ARCHITECTURE: dict[str, FamilySpec] = {}
_BY_MODEL_TYPE: dict[str, FamilySpec] = {}
_BY_VISION_LANGUAGE: dict[str, FamilySpec] = {}  # a vision-language architecture -> the family of its language model


def register_family(spec: FamilySpec) -> None:
    """Make a family known to the bridge (by name, architectures and model types)."""
    if spec.name in FAMILIES:
        raise ValueError(f"model family {spec.name!r} is already registered")
    FAMILIES[spec.name] = spec
    for architecture in spec.architectures:
        _BY_ARCHITECTURE.setdefault(architecture, spec)
    for model_type in spec.model_types:
        _BY_MODEL_TYPE[model_type] = spec
    for architecture in spec.vision_language_architectures:
        _BY_VISION_LANGUAGE[architecture] = spec


def register_hf_classes(model_type: str | None) -> bool:
    """Register the transformers classes a family brings for ``model_type`` (``FamilySpec.hf_classes``)
    with ``AutoConfig`` and ``AutoModelForCausalLM``; False when no family brings any."""
    spec = _BY_MODEL_TYPE.get(model_type)
    if spec is None or spec.hf_classes is None:
        return False
    from transformers import AutoConfig, AutoModelForCausalLM

    config_class, causal_lm = spec.hf_classes()
    AutoConfig.register(model_type, config_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm, exist_ok=True)
    return True


def register_checkpoint_classes(model_dir) -> bool:
    """``register_hf_classes`` for the model type of the checkpoint directory ``model_dir`` (its config.json), so
    that transformers' Auto classes load it (Kimi-K2's ``kimi_k2``); False for anything else (a hub id)."""
    import json
    from pathlib import Path

    config_json = Path(model_dir) / "config.json"
    if not config_json.is_file():
        return False
    return register_hf_classes(json.loads(config_json.read_text()).get("model_type"))


for _spec in _BUILTIN:
    register_family(_spec)


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


VISION_LANGUAGE_ISSUE = 28  # training vision-language models


def vision_language_family(architectures) -> tuple[str, FamilySpec] | None:
    """(the architecture, the family of its language model) for a vision-language model whose language model
    a family reads (``FamilySpec.vision_language_architectures``), else None."""
    for architecture in architectures or []:
        if architecture in _BY_VISION_LANGUAGE:
            return architecture, _BY_VISION_LANGUAGE[architecture]
    return None


def extract_language_model_hint(spec: FamilySpec) -> str:
    """What to do with a vision-language checkpoint whose language model is ``spec``'s."""
    return (f"its language model is the {spec.name} family ({spec.architectures[0]}): write it as a text checkpoint "
            "with `python -m megarl.devtools.extract_language_model SRC OUT` (the vision tower left out) and train OUT")


def vision_language_refusal(architectures) -> str | None:
    """Why such a vision-language checkpoint is refused and how to extract its language model (None: not one)."""
    found = vision_language_family(architectures)
    if found is None:
        return None
    architecture, spec = found
    return (f"{architecture} is a vision-language model, which megarl does not train (planned: issue "
            f"{VISION_LANGUAGE_ISSUE}); {extract_language_model_hint(spec)}")


def family_for(config: PretrainedConfig) -> FamilySpec:
    """The family of an HF config: by ``architectures[0]``, else by ``model_type``.

    The model_type fallback serves configs without architectures and other heads of the same
    backbone (e.g. ``Qwen2ForTokenClassification`` for a critic).
    """
    model_type = getattr(config, "model_type", None)
    architectures = getattr(config, "architectures", None) or []
    refused = vision_language_refusal(architectures)
    if refused:
        raise ValueError(refused)
    by_type = _BY_MODEL_TYPE.get(model_type)
    if by_type is not None and any(a in by_type.architectures for a in architectures):
        return by_type
    for architecture in architectures:
        if architecture in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[architecture]
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"no megatron bridge for architectures={getattr(config, 'architectures', None)} model_type={model_type!r}; "
        f"supported: {', '.join(supported_architectures())} (add a module in megarl/models/families/)"
    )


__all__ = ["FAMILIES", "FamilySpec", "ParamMap", "family_for", "register_family", "register_hf_classes",
           "supported_architectures", "vision_language_family", "vision_language_refusal"]
