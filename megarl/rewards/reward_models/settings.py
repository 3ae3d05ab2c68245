"""What a run's reward model is: its kind, inputs, engines and placement (``megarl.settings.reward_models``
builds it from the config and holds the checks).

``reward_model.model.path`` decides the kind, from its ``config.json``:

* ``...ForSequenceClassification`` with one label: a **discriminative** reward model; its score of
  a response is the head's output at the last token of prompt + response. It is the reward unless
  a custom reward function is given, which then receives it (``rm_score``);
* a causal LM (``...ForCausalLM``): a **generative** reward model, an LLM judge. A custom reward
  function must build the judge's prompt and parse its answer (verl: "genrm must set
  custom_reward_function"); it receives the judge (``judge``, ``reward_router_address``).

Pure: reads ``config.json`` files, starts nothing (the config check runs it before any process).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


DISCRIMINATIVE, GENERATIVE = "discriminative", "generative"
KEY = "reward_model.model.path"


@dataclass(frozen=True)
class JudgeSettings:
    """``reward_model.judge.*``: how the judge client sends requests (``judge.JudgeClient``)."""

    timeout_s: float = 60.0
    max_retries: int = 3
    retry_backoff_s: float = 1.0
    max_concurrent: int = 64
    fallback_score: float = 0.0



@dataclass(frozen=True)
class RewardModelSettings:
    path: str
    kind: str  # DISCRIMINATIVE | GENERATIVE
    retemplate: bool  # decode the responses and apply the reward model's chat template (input_tokenizer set)
    max_length: int  # tokens of one input (a discriminative model's) or prompt + answer (a judge's)
    pool: bool  # its own devices (enable_resource_pool) instead of the trainer's
    trust_remote_code: bool
    judge: JudgeSettings


def model_kind(hf_config: dict) -> str | None:
    """DISCRIMINATIVE, GENERATIVE or None (an architecture megarl does not serve as a reward model)."""
    architectures = list(hf_config.get("architectures") or [])
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return DISCRIMINATIVE
    if any(a.endswith("ForCausalLM") for a in architectures):
        return GENERATIVE
    return None


def read_hf_config(path: str) -> dict:
    return json.loads((Path(path).expanduser() / "config.json").read_text())


def num_labels(hf_config: dict) -> int:
    if "num_labels" in hf_config:
        return int(hf_config["num_labels"])
    return len(hf_config.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})  # transformers' default: 2


