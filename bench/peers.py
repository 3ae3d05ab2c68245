"""megarl against TRL's ``GRPOTrainer`` on the same model, data, reward and hyper-parameters.

    OMP_NUM_THREADS=1 .venv/bin/python bench/peers.py run --side megarl --seed 1 [--steps 30] [--rollout vllm|hf] [--json FILE]
    OMP_NUM_THREADS=1 .venv/bin/python bench/peers.py run --side trl --seed 1 [--steps 30] [--json FILE]
    .venv/bin/python bench/peers.py report [--json FILE]        # summarise every run appended so far
    .venv/bin/python bench/peers.py mapping                     # the hyper-parameter mapping of both sides

One ``run`` is one side and one seed (a chunk short enough for the shared heavy-test lock); each
appends one JSON line to ``--json`` (default ``runs/bench/peers.jsonl``) and ``report`` prints, per
side: start-up (process start to the first step), the median step time and its phase split, the
mean reward of the first and last ``--window`` steps (mean and spread over seeds), and the ratios
megarl/TRL. ``--rollout hf`` runs megarl with its hf rollout backend (``actor_rollout_ref.rollout.name=hf``:
transformers generating in the replicas, as TRL does) instead of vLLM; ``report`` lists it as the side
``megarl-hf``, against TRL and against megarl with vLLM.

Operating points: the quickstart task (``megarl.run.quickstart.prepare``'s format-warmed tiny model and
arithmetic data under ``runs/bench/quickstart``; answers are one digit), 16 prompts x 8 samples, at
most 8 response tokens (``--point short``) or exactly 128 (``--point long``: the samples are held to
their full length, a step-time point), one optimizer step per batch (on-policy: megarl skips its old-log-prob
pass), no KL, fp32, HF generation on the TRL side. ``--model smollm2`` runs the same on
SmolLM2-135M-Instruct (``megarl.devtools.pretrained``) with 4 prompts x 8 samples per step, what 2 CPU
cores take in tens of seconds a step; ``report`` groups the runs by model and point.

TRL is installed into its own environment, ``bench/.venv-trl`` (created on first use: a venv whose
``.pth`` file reuses the project's packages, so torch and transformers are the project's, plus
``trl``, ``datasets``, ``pandas``, ``xxhash`` and ``multiprocess`` installed with ``--no-deps``); the project's
environment never gets TRL.
"""
from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / "bench" / ".venv-trl"
TRL_PACKAGES = ["trl==1.16.0", "datasets==5.2.0", "pandas", "xxhash", "multiprocess"]
RUN_DIR = ROOT / "runs" / "bench" / "quickstart"

# both sides, both operating points
PROMPTS, SAMPLES, LR, CLIP, TEMPERATURE, GRAD_CLIP = 16, 8, 3e-4, 0.2, 1.0, 1.0
# response tokens per sample; "long" forces every sample to its full length (vLLM's ignore_eos,
# HF's min_new_tokens): a step-time operating point, its reward is the same task's
POINTS = {"short": 8, "long": 128}

MAPPING = [
    # (what, megarl, TRL)
    ("what counts as a step", "one batch of 16 prompts x 8 samples: rollout, reward, one optimizer step",
     "one optimizer step; generation_batch_size = 128 completions = one step (steps_per_generation=1)"),
    ("batch", f"data.train_batch_size={PROMPTS} (SmolLM2: 4), rollout.n={SAMPLES}",
     f"per_device_train_batch_size={PROMPTS * SAMPLES} (SmolLM2: 32) completions, num_generations={SAMPLES}"),
    ("updates per batch", f"ppo_mini_batch_size={PROMPTS} (one mini-batch), ppo_epochs=1 -> on-policy",
     "num_iterations=1, gradient_accumulation_steps=1"),
    ("gradient accumulation", "micro-batches summed within the one mini-batch (ppo_micro_batch_size_per_gpu=32; "
     "SmolLM2: 8)",
     "none (one forward of 128 completions)"),
    ("loss aggregation", "loss_agg_mode=token-mean (over the batch's response tokens)",
     "loss_type='dapo' (token-level, normalised by the batch's response tokens)"),
    ("advantage", "GRPO: (r - group mean) / (group std + 1e-6), norm_adv_by_std_in_grpo=True",
     "scale_rewards='group': (r - group mean) / (group std + 1e-4)"),
    ("clipping", f"PPO clip_ratio={CLIP} (both sides), grad_clip={GRAD_CLIP}",
     f"epsilon={CLIP} (epsilon_high=None: symmetric), max_grad_norm={GRAD_CLIP}"),
    ("KL / entropy", "use_kl_loss=False, no KL in reward, entropy_coeff=0", "beta=0.0 (no reference model)"),
    ("optimizer", f"Adam (megatron), lr={LR}, betas 0.9/0.999, eps 1e-8, weight_decay=0",
     f"adamw_torch, learning_rate={LR}, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0"),
    ("LR schedule", "constant, no warm-up (verl's default)", "lr_scheduler_type='constant', warmup_steps=0"),
    ("sampling", f"vLLM (--rollout vllm) or transformers in megarl's hf replicas (--rollout hf), temperature="
     f"{TEMPERATURE}, top_p=1, top_k=-1, max_response_length=8 | 128",
     f"HF generate, temperature={TEMPERATURE}, top_p=1, top_k=0, max_completion_length=8 | 128"),
    ("long point: full length", "actor_rollout_ref.rollout.ignore_eos=True", "generation_kwargs={'min_new_tokens': 128}"),
    ("precision", "fp32 (CPU)", "fp32 (use_cpu=True, bf16=False)"),
    ("data order", "data.shuffle with data.seed=<seed>", "shuffle_dataset=True with seed=<seed>"),
]


def prepared(model: str = "tiny") -> dict[str, Path]:
    """The quickstart's arithmetic data, and its format-warmed tiny model or SmolLM2-135M-Instruct."""
    from megarl.run.quickstart import prepare

    paths = dict(prepare(RUN_DIR))
    if model == "smollm2":
        from megarl.devtools.pretrained import pretrained_model

        paths["model"] = Path(pretrained_model("smollm2"))
    return paths


def batch(model: str) -> tuple[int, int]:
    """(prompts, samples per prompt) of one step: SmolLM2 on 2 CPU cores takes 4 x 8."""
    return (PROMPTS, SAMPLES) if model == "tiny" else (4, SAMPLES)


# ---------------------------------------------------------------- megarl
def run_megarl(args) -> dict:
    import logging

    logging.basicConfig(level=logging.WARNING)
    from megarl.checks import load_config
    from megarl.run.train import run
    from megarl.trainer.controller import RLTrainer

    paths = prepared(args.model)
    prompts, samples = batch(args.model)
    first_step, history = [], []
    original = RLTrainer.train_step

    def timed_step(self, step):
        if not first_step:
            first_step.append(time.perf_counter() - PROCESS_START)
        metrics = original(self, step)
        history.append(dict(metrics))
        return metrics

    RLTrainer.train_step = timed_step
    out = tempfile.mkdtemp(prefix="megarl_peers_")
    overrides = [
        f"data.train_files={paths['data'] / 'train.parquet'}", f"data.val_files={paths['data'] / 'test.parquet'}",
        f"actor_rollout_ref.model.path={paths['model']}", f"data.train_batch_size={prompts}",
        f"data.max_response_length={POINTS[args.point]}", f"actor_rollout_ref.rollout.n={samples}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", f"actor_rollout_ref.actor.optim.lr={LR}",
        f"actor_rollout_ref.actor.clip_ratio={CLIP}", f"actor_rollout_ref.actor.grad_clip={GRAD_CLIP}",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=False",
        "trainer.save_freq=-1", "trainer.logger=[console]", f"trainer.default_local_dir={out}",
        f"data.seed={args.seed}", f"actor_rollout_ref.rollout.seed={args.seed}",
        f"actor_rollout_ref.actor.megatron.seed={args.seed}",
        f"actor_rollout_ref.rollout.name={args.rollout}",
    ] + (["actor_rollout_ref.rollout.ignore_eos=True"] if args.point == "long" else []) + (
        # 32 x 172 tokens in one micro-batch peak at 18 GB in fp32 (its 49k-vocab logits and 30 layers'
        # activations); 8 per micro-batch is the same update (token-mean summed over the mini-batch)
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"] if args.model == "smollm2" else []
    ) + list(args.set)
    run(load_config("quickstart", overrides))
    phases = ("gen", "reward", "old_log_prob", "adv", "update_actor", "sync")
    return {
        "startup_s": first_step[0] if first_step else None,
        "step_s": [h["timing_s/step"] for h in history],
        "phases_s": {p: [h.get(f"timing_s/{p}", 0.0) for h in history] for p in phases},
        "reward": [h["critic/score/mean"] for h in history],
    }


# ---------------------------------------------------------------- TRL (inside bench/.venv-trl)
def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    if python.exists():
        return python
    import site

    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    found = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                           capture_output=True, text=True).stdout.strip()
    Path(found, "megarl_project.pth").write_text(site.getsitepackages()[0] + "\n")  # the project's torch & co
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *TRL_PACKAGES], check=True)
    return python


def run_trl(args) -> dict:
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.rewards.arithmetic import compute_score

    paths = {"data": RUN_DIR / "data", "model": Path(args.model_path)}  # prepared by the parent process
    prompts, samples = batch(args.model)
    rows = pq.read_table(paths["data"] / "train.parquet").to_pylist()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(r["reward_model"]["ground_truth"])}
                                 for r in rows])

    def reward(prompts, completions, ground_truth, **_):
        return [compute_score(c[0]["content"] if isinstance(c, list) else c, g) for c, g in zip(completions, ground_truth)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_peers_"), use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        per_device_train_batch_size=prompts * samples, num_generations=samples, gradient_accumulation_steps=1,
        num_iterations=1, max_completion_length=POINTS[args.point],
        generation_kwargs={"min_new_tokens": POINTS[args.point]} if args.point == "long" else None,
        temperature=TEMPERATURE, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=GRAD_CLIP, beta=0.0, epsilon=CLIP,
        loss_type="dapo", scale_rewards="group", max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to=[], dataloader_num_workers=0, disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    steps, first_step = [], []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.begin = time.perf_counter()
            if not first_step:
                first_step.append(self.begin - PROCESS_START)

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - self.begin)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    generation = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generation.append(time.perf_counter() - start)

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {"startup_s": first_step[0] if first_step else None, "step_s": steps,
            "phases_s": {"generate+score": generation, "update": [s - g for s, g in zip(steps, generation)]},
            "reward": rewards}


# ---------------------------------------------------------------- report
def summarise(records: list[dict], window: int) -> None:
    print("hyper-parameter mapping:")
    print_mapping()
    for model in ("tiny", "smollm2"):
        for point in POINTS:
            picked = [r for r in records if r.get("point", "short") == point and r.get("model", "tiny") == model
                      and not r.get("overrides")]
            if picked:
                prompts, samples = batch(model)
                print(f"\n=== {point} responses ({POINTS[point]} tokens), {model} model, {prompts} x {samples} ===")
                summarise_point(picked, window, point)


def summarise_point(records: list[dict], window: int, point: str) -> None:
    sides = {}
    for r in records:
        sides.setdefault(side_name(r), []).append(r)
    medians = {}
    for side, runs in sides.items():
        steady = [s for r in runs for s in r["step_s"][1:]]  # the first step pays warm-ups
        medians[side] = statistics.median(steady) if steady else float("nan")
        startup = [r["startup_s"] for r in runs if r["startup_s"] is not None]
        phase_names = runs[0]["phases_s"]
        split = ", ".join(f"{p} {statistics.median([x for r in runs for x in r['phases_s'][p][1:]] or [0]):.3f}"
                          for p in phase_names)
        first = [statistics.mean(r["reward"][:window]) for r in runs if r["reward"]]
        last = [statistics.mean(r["reward"][-window:]) for r in runs if r["reward"]]
        spread = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else float("nan"))
        steps = sorted({len(r["reward"]) for r in runs})
        print(f"{side}: {len(runs)} seed(s) {sorted(r['seed'] for r in runs)}, steps {steps}")
        print(f"  start-up to the first step: median {statistics.median(startup):.1f} s" if startup else "  start-up: -")
        print(f"  step time (median of steps 2..N): {medians[side]:.3f} s; phases (median s): {split}")
        print(f"  reward, mean of the first {window} steps: {statistics.mean(first):.3f} +- {spread(first):.3f}; "
              f"of the last {window}: {statistics.mean(last):.3f} +- {spread(last):.3f} (mean +- stdev over seeds)")
        print("  reward per step (mean over seeds): " + " ".join(
            f"{statistics.mean(r['reward'][i] for r in runs if len(r['reward']) > i):.2f}"
            for i in range(max(len(r["reward"]) for r in runs))))
    if "megarl" in medians and "trl" in medians:
        target = "<= 1.0" if point == "short" else "<= 0.5"
        print(f"step time megarl/TRL-HF: {medians['megarl'] / medians['trl']:.2f} (target {target})")
    if "megarl-hf" in medians:
        for other, label in (("trl", "TRL-HF"), ("megarl", "megarl (vLLM)")):
            if other in medians:
                print(f"step time megarl-hf/{label}: {medians['megarl-hf'] / medians[other]:.2f}")


def side_name(record: dict) -> str:
    """``megarl``, ``megarl-hf`` (megarl with its hf rollout backend) or ``trl``."""
    return record["side"] + ("-hf" if record["side"] == "megarl" and record.get("rollout") == "hf" else "")


def print_mapping() -> None:
    width = max(len(w) for w, _, _ in MAPPING)
    for what, ours, theirs in MAPPING:
        print(f"  {what:<{width}}  megarl: {ours}\n  {'':<{width}}  TRL:    {theirs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one side, one seed")
    one.add_argument("--side", choices=["megarl", "trl"], required=True)
    one.add_argument("--seed", type=int, default=1)
    one.add_argument("--steps", type=int, default=30)
    one.add_argument("--point", choices=sorted(POINTS), default="short", help="short (8) or long (128) responses")
    one.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                     help="the quickstart's tiny model (16 x 8 per step) or SmolLM2-135M-Instruct (4 x 8)")
    one.add_argument("--rollout", choices=["vllm", "hf"], default="vllm",
                     help="megarl's rollout backend (actor_rollout_ref.rollout.name); TRL always generates with HF")
    one.add_argument("--model-path", help=argparse.SUPPRESS)
    one.add_argument("--json", type=Path, default=ROOT / "runs" / "bench" / "peers.jsonl")
    one.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="an extra megarl config override (megarl side; recorded with the run)")
    one.add_argument("--inside-trl-venv", action="store_true", help=argparse.SUPPRESS)
    report = sub.add_parser("report", help="summarise the runs in --json")
    report.add_argument("--json", type=Path, default=ROOT / "runs" / "bench" / "peers.jsonl")
    report.add_argument("--window", type=int, default=5, help="steps averaged for the first and last reward")
    sub.add_parser("mapping", help="print the hyper-parameter mapping")
    args = parser.parse_args()

    if args.command == "mapping":
        return print_mapping()
    if args.command == "report":
        records = [json.loads(line) for line in args.json.read_text().splitlines() if line.strip()]
        return summarise(records, args.window)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is left out of the step time)")
    if args.side == "trl" and args.rollout != "vllm":
        parser.error("--rollout picks megarl's rollout backend; TRL's side always generates with HF")
    if args.side == "trl" and not args.inside_trl_venv:
        paths = prepared(args.model)  # the model and data, made with the project's environment
        python = ensure_trl_venv()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        command = [str(python), __file__, "run", "--side", "trl", "--seed", str(args.seed), "--steps", str(args.steps),
                   "--point", args.point, "--model", args.model, "--model-path", str(paths["model"]),
                   "--json", str(args.json), "--inside-trl-venv"]
        sys.exit(subprocess.run(command, env=env).returncode)
    result = run_megarl(args) if args.side == "megarl" else run_trl(args)
    record = {"side": args.side, "seed": args.seed, "steps": args.steps, "point": args.point, "model": args.model,
              "rollout": args.rollout if args.side == "megarl" else None, "overrides": list(args.set), **result}
    print(f"{side_name(record)} seed {args.seed}: start-up {result['startup_s']:.1f} s, median step "
          f"{statistics.median(result['step_s'][1:]):.3f} s, reward first/last {result['reward'][0]:.3f}/"
          f"{result['reward'][-1]:.3f}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with args.json.open("a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
