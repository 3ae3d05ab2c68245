"""verl's ``<model>.override_config.model_config``: fields of the Hugging Face config set before the bridge reads it.

verl applies them to the HF config its Megatron models are built from (``update_model_config``), e.g.
``max_position_embeddings=10240`` to train past the checkpoint's context length. megarl applies the
same fields to every model built from that checkpoint (actor, reference, critic: each role's own
section), to the HF exports written with its checkpoints, and to the rollout engines (vLLM's
``hf_overrides``; the hf backend's config), so the fleet samples from the model the trainer trains.

Only fields that keep the checkpoint's tensors are accepted: an override that would change a tensor's
shape or name (``hidden_size``, ``num_hidden_layers``, ``vocab_size``, ...) would no longer fit the
weights, and a field the config does not have would be set and read by nothing. Both are refused before
start (``override_problems``), naming the fields.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from transformers import PretrainedConfig


def apply_overrides(config: PretrainedConfig, overrides: Mapping[str, Any] | None) -> PretrainedConfig:
    """A copy of ``config`` with ``overrides`` set (``config`` itself when there are none)."""
    if not overrides:
        return config
    changed = copy.deepcopy(config)
    text = changed.get_text_config()  # a vision-language config keeps its language model's fields there
    for name, value in overrides.items():
        target = text if hasattr(text, name) else changed
        if not hasattr(target, name):
            raise ValueError(f"the model's config has no field {name!r} to override")
        setattr(target, name, copy.deepcopy(value))
    return changed


def override_problems(key: str, model_dir: str, overrides: Mapping[str, Any], role: str = "actor") -> list[str]:
    """What is wrong with ``overrides`` for the checkpoint in ``model_dir`` (``key``: the config section named in
    the messages): fields the config does not have, and fields that would change its tensors."""
    from megarl.models.dims import load_hf_config
    from megarl.models.shards import hf_tensor_shapes

    if not overrides:
        return []
    config = load_hf_config(model_dir)
    text = config.get_text_config()
    unknown = sorted(name for name in overrides if not (hasattr(text, name) or hasattr(config, name)))
    if unknown:
        return [f"{key}.{unknown[0]}: {model_dir}'s config.json has no field "
                f"{', '.join(map(repr, unknown))}; override only fields the model's config has"]
    before = hf_tensor_shapes(config, role)
    if not _keeps_tensors(config, overrides, before, role):
        changed = sorted(name for name in overrides if not _keeps_tensors(config, {name: overrides[name]}, before, role))
        names = ", ".join(changed) or ", ".join(sorted(overrides))
        return [f"{key}: overriding {names} would change the model's tensors (their names or shapes), which would no "
                f"longer fit {model_dir}'s weights; override only fields such as max_position_embeddings, rope "
                "settings or norm epsilons, or convert a checkpoint of the other shape"]
    return []


def _keeps_tensors(config: PretrainedConfig, overrides: Mapping[str, Any], shapes: dict, role: str) -> bool:
    from megarl.models.shards import hf_tensor_shapes

    try:
        return hf_tensor_shapes(apply_overrides(config, overrides), role) == shapes
    except Exception:  # noqa: BLE001 - a field the bridge cannot read at that value changes the model too
        return False
