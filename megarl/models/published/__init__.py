"""The published config.json of the models megarl's packaged configs train (no weights).

``megarl plan`` reads them when the configured ``model.path`` is not on this machine and names one
of these models (its directory name, e.g. ``/models/Llama-3.1-70B-Instruct``, or a hub id such as
``deepseek-ai/DeepSeek-V3``); the tests use them as real-sized architectures.

    llama-3.1-70b     meta-llama/Llama-3.1-70B(-Instruct)
    deepseek-v3       deepseek-ai/DeepSeek-V3 (FP8 as published; the planner counts bf16)
    qwen3-235b-a22b   Qwen/Qwen3-235B-A22B
    smollm2-135m      HuggingFaceTB/SmolLM2-135M-Instruct
    qwen2.5-vl-7b     Qwen/Qwen2.5-VL-7B-Instruct (vision-language; transformers 4.x's flat layout)
    qwen3-vl-8b       Qwen/Qwen3-VL-8B-Instruct (vision-language; text_config / vision_config)
"""
from __future__ import annotations

import re
from pathlib import Path

PUBLISHED = Path(__file__).resolve().parent


def published_config_dir(name: str) -> Path:
    """The directory holding ``name``'s published config.json (``name`` as listed above)."""
    directory = PUBLISHED / name
    if not (directory / "config.json").is_file():
        known = sorted(p.name for p in PUBLISHED.iterdir() if (p / "config.json").is_file())
        raise FileNotFoundError(f"no published config for {name!r}; known: {known}")
    return directory


def match_published(path_or_id: str) -> Path | None:
    """The published config directory a model path or hub id names, or None.

    The last path component is compared without case, punctuation and the usual suffixes
    (``-Instruct``, ``-Base``, ``-bf16``, ``-config``...): ``/models/Llama-3.1-70B-Instruct`` and
    ``meta-llama/Llama-3.1-70B`` both give ``llama-3.1-70b``.
    """
    def key(text: str) -> str:
        text = re.sub(r"[-_.]?(instruct|chat|base|bf16|fp8|hf|config|verl)\b", "", text.lower())
        return re.sub(r"[^a-z0-9]", "", text)

    wanted = key(str(path_or_id).rstrip("/").rsplit("/", 1)[-1])
    for directory in sorted(PUBLISHED.iterdir()):
        if (directory / "config.json").is_file() and key(directory.name) == wanted:
            return directory
    return None
