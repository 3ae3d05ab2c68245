"""A format warm-up for the tiny vision-language models: answer an image prompt with one digit, then stop.

Why: a random tiny model never writes a digit, so RL from it sees no reward. As the quickstart's text
warm-up does (``megarl.run.quickstart.format_warmup``), this teaches the *format* only: the targets
are random digits among the task's answers, independent of the image, so whatever accuracy RL reaches
afterwards is learned from the reward (``megarl.devtools.visual_task`` and its blanked control).

The batches go through the checkpoint's own ``AutoProcessor`` (chat template, image resizing, pixel
values), and the loss is on the answer and the end-of-turn token only.
"""
from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Sequence


def _example(processor, messages: list[dict], image, answer: str) -> tuple[dict, int]:
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = processor(text=[prompt + answer + "<|im_end|>"], images=[image], return_tensors="pt")
    start = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"].shape[1]
    return full, start


def warmup_on_images(model_dir: Path, out_dir: Path, rows: Sequence[dict], answers: Sequence[str], steps: int = 40,
                     lr: float = 1e-3, batch_size: int = 8, seed: int = 0, label: str = "vision format warm-up") -> Path:
    """Fine-tune the VL checkpoint ``model_dir`` on ``rows`` (verl-format rows with one image each) answered by a
    random one of ``answers``; write ``out_dir`` (checkpoint, tokenizer and processor) and return it."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if (out_dir / "config.json").is_file():
        return out_dir
    torch.manual_seed(seed)
    rng = random.Random(seed)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    start = time.perf_counter()
    for step in range(steps):
        loss_sum = 0.0
        for _ in range(batch_size):  # one row at a time: rows differ in image size (no padding to manage)
            row = rows[rng.randrange(len(rows))]
            messages = [{"role": m["role"], "content": [{"type": "image"}, {"type": "text", "text": m["content"].replace("<image>", "")}]}
                        for m in row["prompt"]]
            image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
            inputs, answer_start = _example(processor, messages, image, rng.choice(list(answers)))
            labels = inputs["input_ids"].clone()
            labels[:, :answer_start] = -100
            loss = model(**inputs, labels=labels).loss / batch_size
            loss.backward()
            loss_sum += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"[{label}] step {step + 1}/{steps}: loss {loss_sum:.3f} "
                  f"({(step + 1) / (time.perf_counter() - start):.1f} steps/s)", flush=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
