"""Where a model named in a config is, and whether the bridge can train it (read before any process starts).

``resolve_model_path`` finds a local directory or a hub id's snapshot in the Hugging Face cache;
``model_problems`` names what is wrong with a path (missing, no ``config.json``, an architecture
the bridge has no family for), one ``Problem`` per fault, naming the key.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megarl.config.errors import Problem, refusal

# Architectures the bridge lacks whose support is planned (or known to be a separate product line).
PLANNED_ARCHITECTURES = {"DeepseekV2ForCausalLM": ("DeepSeek-V2 models (softmax group-limited greedy routing)", None)}


def resolve_model_path(path: str) -> str | None:
    """A local model directory for ``path``: itself, or a hub id's snapshot in the HF cache (None: neither)."""
    local = Path(os.path.expanduser(str(path)))
    if local.is_dir():
        return str(local)
    if local.is_absolute() or str(path).startswith((".", "~")) or str(path).count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(str(path), "config.json")
    except Exception:  # an id the hub library rejects
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def model_problems(key: str, path: Any, needs_family: bool = True) -> list[Problem]:
    if not path:
        return [Problem(f"{key} is empty: give a Hugging Face model directory or hub id", key=key)]
    local = resolve_model_path(str(path))
    if local is None:
        if str(path).count("/") == 1 and not Path(str(path)).is_absolute():
            offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
            return [Problem(f"{key}={path}: not a local directory and not in the Hugging Face cache{offline}; "
                            f"download it first (huggingface-cli download {path}) or give a local path", key=key)]
        return [Problem(f"{key}={path}: no such directory", key=key)]
    config_file = Path(local) / "config.json"
    if not config_file.is_file():
        if needs_family or not (Path(local) / "tokenizer_config.json").is_file():
            return [Problem(f"{key}={path}: {local} has no config.json; give a Hugging Face checkpoint directory "
                            "(megarl make-tiny-model writes one)", key=key)]
        return []
    if not needs_family:
        return []
    try:
        hf_config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [Problem(f"{key}={path}: cannot read {config_file}: {exc}", key=key)]
    return _family_problems(key, path, hf_config)


def _family_problems(key: str, path: Any, hf_config: dict) -> list[Problem]:
    from megarl.models.families import supported_architectures

    architectures = list(hf_config.get("architectures") or [])
    supported = set(supported_architectures())
    if any(a in supported for a in architectures):
        return []
    arch = architectures[0] if architectures else f"model_type={hf_config.get('model_type')!r}"
    instead = f"the bridge's families are {', '.join(sorted(supported))} (megarl.models.families)"
    if arch in PLANNED_ARCHITECTURES:
        feature, issue = PLANNED_ARCHITECTURES[arch]
        return [refusal(f"{key}={path}", feature, instead, issue)]
    from megarl.models.families import VISION_LANGUAGE_ISSUE, extract_language_model_hint, vision_language_family

    found = vision_language_family(architectures)
    if found is not None:
        return [refusal(f"{key}={path}", f"vision-language models ({arch})", extract_language_model_hint(found[1]),
                        VISION_LANGUAGE_ISSUE)]
    if "vision_config" in hf_config or "ForConditionalGeneration" in arch or "VL" in arch:
        return [refusal(f"{key}={path}", f"vision-language models ({arch})", "megarl trains text-only causal LMs; "
                        + instead)]
    return [refusal(f"{key}={path}", f"the {arch} architecture", instead)]
