"""A format warm-up on whole conversations (tool calls included), for the tiny models of tests and demos.

``warmup_on_conversations`` fine-tunes a Hugging Face checkpoint for a few steps on conversations
rendered with its chat template (and tool schemas), with the loss on the assistant turns only: the
model learns a *format* (call a tool like this, then answer like that). What the conversations
say is up to the caller; the tests use targets that carry no information about the right answer,
so whatever accuracy RL reaches afterwards is learned from the reward (see quickstart's warm-up).
"""
from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Callable

from megarl.agent.chat import encode, render_text


def conversation_tokens(tokenizer, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and labels (-100 except on assistant turns)."""
    ids, labels, done = [], [], ""

    def add(text: str, train: bool) -> None:
        piece = encode(tokenizer, text)
        ids.extend(piece)
        labels.extend(piece if train else [-100] * len(piece))

    for j, message in enumerate(messages):
        upto = render_text(tokenizer, messages[: j + 1], tools, False)
        if message["role"] == "assistant":
            opening = render_text(tokenizer, messages[:j], tools, True)
            add(opening[len(done):], False)
            add(upto[len(opening):], True)
        else:
            add(upto[len(done):], False)
        done = upto
    if ids != encode(tokenizer, done):
        raise ValueError("the chat template does not render the conversation turn by turn; cannot warm up on it")
    return ids, labels


def warmup_on_conversations(model_dir: Path, out_dir: Path, make_conversation: Callable[[random.Random], list[dict]],
                            tools: list | None, steps: int = 60, lr: float = 1e-3, batch_size: int = 16,
                            seed: int = 0, label: str = "warm-up", weight_decay: float = 0.0) -> Path:
    """Fine-tune ``model_dir`` on ``steps`` batches of ``make_conversation(rng)``; write ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    for step in range(steps):
        rows = [conversation_tokens(tokenizer, make_conversation(rng), tools) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
        lab = torch.tensor([lb + [-100] * (width - len(lb)) for _, lb in rows])
        att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            print(f"[{label}] step {step + 1}/{steps}: loss {loss.item():.3f} "
                  f"({(step + 1) / (time.perf_counter() - start):.1f} steps/s)", flush=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
