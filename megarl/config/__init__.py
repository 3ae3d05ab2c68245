"""Typed config with verl's key names and command line: composition (Hydra), key screening,
types, cross-key rules and pre-flight checks of files, all reported in one pass before any
process starts.

Layers, each importing only those above it: ``errors`` (Problem, ConfigError) -> ``schema`` ->
``verl_keys`` (verl's other keys) -> ``screen`` -> ``compose`` -> ``loader`` -> ``validate`` /
``preflight`` (lazily, from ``loader``) -> ``command_line``.
"""
from megarl.config.compose import CONFIG_DIR, DEFAULT_CONFIG
from megarl.config.errors import ConfigError, Problem
from megarl.config.loader import load_config, resolve_config_path, to_yaml
from megarl.config.schema import MegaRLConfig
from megarl.config.screen import schema_keys
from megarl.config.validate import critic_enabled, devices_for, validate_config

__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "ConfigError", "MegaRLConfig", "Problem", "critic_enabled", "devices_for",
           "load_config", "resolve_config_path", "schema_keys", "to_yaml", "validate_config"]
