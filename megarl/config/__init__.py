"""Typed config: YAML + dotted overrides with verl's key names, validated before any process starts."""
from megarl.config.loader import ConfigError, load_config, parse_overrides, resolve_config_path, schema_keys, to_yaml
from megarl.config.schema import MegaRLConfig
from megarl.config.validate import critic_enabled, devices_for, validate_config

__all__ = ["ConfigError", "MegaRLConfig", "critic_enabled", "devices_for", "load_config", "parse_overrides",
           "resolve_config_path", "schema_keys", "to_yaml", "validate_config"]
