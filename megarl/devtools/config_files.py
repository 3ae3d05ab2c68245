"""Small files the config checks read: a model directory's config.json, verl-format parquet files.

Used by the tests (``tests/config/_fixtures.py`` re-exports them) and by ``megarl.devtools.key_readers``,
which runs the launch's config door on stand-in files to find each key's readers."""
from __future__ import annotations

import json
from pathlib import Path


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
    import pyarrow as pa
    import pyarrow.parquet as pq

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
