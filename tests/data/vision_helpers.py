"""Helpers for the vision-language data tests: images drawn locally, and verl's geo3k parquet written as
``examples/data_preprocess/geo3k.py`` writes it (``datasets``' ``to_parquet``: the images column a list of
``{"bytes", "path"}`` structs, the features in the schema's ``huggingface`` metadata)."""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

GEO3K_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
               r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
               r"BE put in \boxed{}.")


def noise_image(height: int, width: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = np.random.RandomState(seed).randint(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if mode == "L" else array, mode)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


_GEO3K_FEATURES = {
    "data_source": {"dtype": "string", "_type": "Value"},
    "prompt": [{"content": {"dtype": "string", "_type": "Value"}, "role": {"dtype": "string", "_type": "Value"}}],
    "images": [{"_type": "Image"}],
    "ability": {"dtype": "string", "_type": "Value"},
    "reward_model": {"ground_truth": {"dtype": "string", "_type": "Value"},
                     "style": {"dtype": "string", "_type": "Value"}},
    "extra_info": {"answer": {"dtype": "string", "_type": "Value"}, "index": {"dtype": "int64", "_type": "Value"},
                   "question": {"dtype": "string", "_type": "Value"}, "split": {"dtype": "string", "_type": "Value"}},
}


def geo3k_row(problem: str, answer: str, images: list[Image.Image], index: int, split: str = "train") -> dict:
    """``process_fn`` of geo3k.py on one example; the images as ``datasets`` encodes a decoded ``Image``."""
    return {
        "data_source": GEO3K_SOURCE,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "images": [{"bytes": png(image), "path": None} for image in images],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
    }


def write_geo3k(rows: list[dict], path) -> str:
    image = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("images", image),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()),
                                  ("split", pa.string())])),
    ], metadata={b"huggingface": json.dumps({"info": {"features": _GEO3K_FEATURES}}).encode()})
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)
