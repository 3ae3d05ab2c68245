"""Typed config with verl's key names and command line: composition (Hydra), key screening and
types, all reported in one pass before any process starts. The rules that need the components
(and the files a run reads) are ``megarl.checks``, above them all; ``megarl.checks.load_config``
is the loader launches and tools call.

Layers, each importing only those above it: ``errors`` (Problem, ConfigError) -> ``schema`` ->
``verl_keys`` (verl's other keys) -> ``screen`` -> ``compose`` -> ``loader`` -> ``command_line``;
``derived`` (what a config implies: device counts, the old-log-prob pass) reads the typed tree alone.
"""
from megarl.config.compose import CONFIG_DIR, DEFAULT_CONFIG
from megarl.config.derived import devices_for
from megarl.config.errors import ConfigError, Problem
from megarl.config.loader import compose_config, resolve_config_path, to_yaml
from megarl.config.schema import MegaRLConfig
from megarl.config.screen import schema_keys

__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "ConfigError", "MegaRLConfig", "Problem", "compose_config", "devices_for",
           "resolve_config_path", "schema_keys", "to_yaml"]
