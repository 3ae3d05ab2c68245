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
    gemma-2-27b       google/gemma-2-27b (fp32 as published)
    gemma-3-27b       google/gemma-3-27b-it's text_config as Gemma3ForCausalLM (the published checkpoint is
                      vision-language; the text config as megarl.devtools.extract_language_model writes it)
    glm-4.5           zai-org/GLM-4.5 (355B-A32B; its MTP layer is skipped)
    qwen3-next-80b-a3b  Qwen/Qwen3-Next-80B-A3B (the -Thinking file; -Instruct shares the architecture)
    qwen3.5-397b-a17b   Qwen/Qwen3.5-397B-A17B's text_config as Qwen3_5MoeForCausalLM (text_config of the
                      vision-language checkpoint, as extract_language_model writes it; MTP layer skipped)
    gpt-oss-120b      openai/gpt-oss-120b (MXFP4 experts as published; the planner counts bf16)
    kimi-k2           moonshotai/Kimi-K2-Instruct (DeepSeek-V3's architecture; FP8 as published, the planner
                      counts bf16)
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
    (``-Instruct``, ``-Base``, ``-bf16``, ``-config``..., and Gemma's ``-it`` after a separator):
    ``/models/Llama-3.1-70B-Instruct`` and ``meta-llama/Llama-3.1-70B`` both give ``llama-3.1-70b``,
    ``google/gemma-3-27b-it`` gives ``gemma-3-27b``.
    """
    def key(text: str) -> str:
        text = re.sub(r"[-_.]?(instruct|chat|base|bf16|fp8|hf|config|verl)\b", "", text.lower())
        text = re.sub(r"[-_.]it\b", "", text)  # "-it" only as a suffix of its own, not the end of a word
        return re.sub(r"[^a-z0-9]", "", text)

    wanted = key(str(path_or_id).rstrip("/").rsplit("/", 1)[-1])
    for directory in sorted(PUBLISHED.iterdir()):
        if (directory / "config.json").is_file() and key(directory.name) == wanted:
            return directory
    return None
