"""Small files the config checks read: a model directory's config.json, verl-format parquet files."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_model_config(folder: Path, architecture: str = "Qwen2ForCausalLM", model_type: str = "qwen2",
                       **fields) -> Path:
    """A model directory as far as the config checks read one: its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "model_type": model_type, "hidden_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, **fields}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_prompts(path: Path, rows: int = 8, data_source: str | None = "openai/gsm8k", extra_columns: dict | None = None) -> Path:
    """verl's RL parquet: prompt (chat messages), reward_model, and data_source unless None."""
    columns = {
        "prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(rows)],
        "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(rows)],
        "extra_info": [{"index": i} for i in range(rows)],
        **(extra_columns or {}),
    }
    if data_source is not None:
        columns["data_source"] = [data_source] * rows
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


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
