"""The door between the config and the components: what a checked config implies, built once.

The components take typed settings: their own frozen dataclasses, or the typed schema section that
is theirs (``typed_config``: the checked config as ``megarl.config.schema`` dataclasses), never the
raw config tree. The functions here are where each key is read (the index of who reads what):
``data``, ``agent``, ``rollout``, ``sync``, ``rewards``, ``reward_models``, ``cluster``, ``engine``,
``trainer``; ``derived`` holds the facts that need the components' registries (an estimator that
needs a critic, ...). Pure-config facts (cluster shape, devices, the old-log-prob pass) stay in
``megarl.config.derived``.
"""
from __future__ import annotations

from typing import Any


def plain(value: Any) -> Any:
    """A config node as plain Python containers (resolved); any other value as it is."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def typed_config(cfg: Any):
    """The checked config as typed dataclasses (``megarl.config.schema.MegaRLConfig``): what components get
    sections of. Free-form sections (``override_transformer_config``, ``engine_kwargs``...) are plain dicts."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg) if OmegaConf.is_config(cfg) else cfg
