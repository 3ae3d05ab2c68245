"""A synthetic visual task for vision-language RL tests: name the colour of the shape drawn in the image.

Why: a learning test must show that the policy uses the image. Here the prompt is the same for every
row ("which colour is the shape?"), so the answer is in the pixels only: a run that sees the images
can reach full reward, while the control run, whose images are blanked (``blank=True``: the same
sizes, nothing drawn), cannot beat guessing among the colours. The answer is one digit (1 red, 2
green, 3 blue), scored by the built-in ``megarl/arithmetic`` reward (the first number of the
response), so a tiny model warmed up to answer with a digit starts at chance.

Rows are written as verl's multimodal parquet (``examples/data_preprocess/geo3k.py``'s columns:
``data_source``, ``prompt`` with an ``<image>`` placeholder, ``images`` as ``[{"bytes": png}]``,
``ability``, ``reward_model``, ``extra_info``), so they also exercise the data loader's image path.
"""
from __future__ import annotations

import io
import random
from pathlib import Path

COLOURS = {"1": (220, 30, 30), "2": (30, 180, 30), "3": (30, 60, 220)}  # answer digit -> RGB
QUESTION = "<image>Which colour is the shape? Answer with one digit: 1 red, 2 green, 3 blue."
BACKGROUND = (235, 235, 235)


def shape_image(colour: tuple[int, int, int] | None, rng: random.Random):
    """A light-grey image with one filled square or circle of ``colour`` (None: nothing drawn), 56-112 px a side."""
    from PIL import Image, ImageDraw

    width, height = rng.randrange(56, 113), rng.randrange(56, 113)
    image = Image.new("RGB", (width, height), BACKGROUND)
    if colour is not None:
        size = rng.randrange(min(width, height) // 2, min(width, height) - 4)
        x, y = rng.randrange(0, width - size), rng.randrange(0, height - size)
        draw = ImageDraw.Draw(image)
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x, y, x + size, y + size], fill=colour)
    return image


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def shape_rows(count: int, seed: int = 0, blank: bool = False, split: str = "train") -> list[dict]:
    """``count`` rows in verl's multimodal format; ``blank``: the control, the same rows with no shape drawn."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        answer = rng.choice(sorted(COLOURS))
        drawing = random.Random(rng.random())  # the same geometry whether blanked or not
        image = shape_image(None if blank else COLOURS[answer], drawing)
        rows.append({
            "data_source": "megarl/arithmetic",
            "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": png_bytes(image), "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index},
        })
    return rows


def write_shape_parquet(path: str | Path, count: int, seed: int = 0, blank: bool = False, split: str = "train") -> Path:
    """Write ``shape_rows`` to ``path`` (parquet, as ``datasets.Dataset.to_parquet`` writes verl's data)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(shape_rows(count, seed, blank, split)), path)
    return path
