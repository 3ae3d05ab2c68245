"""Small files the config checks read: a model directory's config.json, verl-format parquet files."""
from __future__ import annotations

import json
from pathlib import Path

from megarl.checks import ConfigError, load_config
from megarl.devtools.config_files import write_model_config, write_prompts  # noqa: F401 (re-exported)


CHECKPOINT_FILES = {"__0_0.distcp": 4000, "__0_1.distcp": 3000, "common.pt": 700, ".metadata": 900, "metadata.json": 100}


def write_saved_checkpoint(root: Path, role: str, step: int, latest: bool = True) -> Path:
    """``root/role/step_<step>`` with the files a save leaves (random contents), ``megarl_checkpoint.json``
    and the manifest, and ``root/role/latest`` naming it."""
    import os

    from megarl.engine.checkpoint import META_FILE
    from megarl.engine.manifest import write_manifest

    path = root / role / f"step_{step}"
    path.mkdir(parents=True)
    for name, size in CHECKPOINT_FILES.items():
        (path / name).write_bytes(os.urandom(size))
    (path / META_FILE).write_text(json.dumps({"step": step, "contents": ["model"]}) + "\n")
    write_manifest(path)
    if latest:
        (root / role / "latest").write_text(f"step_{step}\n")
    return path


def problem_messages(*overrides: str, config: str | None = None, preflight: bool = False) -> list[str]:
    """The messages of every problem ``overrides`` on ``config`` (None: the default) give; [] when it loads."""
    try:
        load_config(config, list(overrides), preflight=preflight)
    except ConfigError as exc:
        return [p.message for p in exc.problems]
    return []
