"""Write verl-format parquet datasets.

    python -m megarl.data.prepare gsm8k [--input-dir DIR] [--output-dir DIR] [--multiturn]
    python -m megarl.data.prepare arithmetic [--output-dir DIR] [--num-train N] [--num-test N]
                                             [--seed S] [--max-operand K] [--ops +,-,*]

``gsm8k`` follows verl's ``examples/data_preprocess/gsm8k.py``: the question plus
an instruction to answer after "####", data_source ``openai/gsm8k``, ability
``math``, and the number after "####" in the reference answer (commas removed) as
the ground truth. It reads ``train.jsonl`` and ``test.jsonl`` from the GSM8K
repository (default: ``shared/data/gsm8k`` next to this repository). ``--multiturn`` writes
verl's tool-calling variant (``gsm8k_multiturn_w_tool``): a system prompt asking the model to
check its answer with the ``calc_gsm8k_reward`` tool (verl's ``gsm8k_tool_config.yaml``),
``agent_name=tool_agent``, and the ground truth in
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs``.

``arithmetic`` generates a tiny synthetic task (``a + b`` with one-digit operands
by default) that a small randomly initialised model can learn in a few minutes on CPU.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import random
import re
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GSM8K_INPUT = REPO_ROOT.parent / "shared" / "data" / "gsm8k"

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ARITHMETIC_DATA_SOURCE = "megarl/arithmetic"
ARITHMETIC_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}

_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_final_answer(answer: str) -> str:
    """The number after "####" in a GSM8K reference answer, commas removed."""
    match = _GSM8K_ANSWER.search(answer)
    if match is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


GSM8K_TOOL_SYSTEM = ("You are a math expert. Solve the question step by step. After solving it, check your answer "
                     "with the `calc_gsm8k_reward` tool at least once before the final answer, and refine the answer "
                     "if the tool says it is wrong. Put the final answer in the format `#### <answer>`.")
GSM8K_TOOL_NAME = "calc_gsm8k_reward"


def gsm8k_rows(path: Path, split: str, multiturn: bool = False) -> list[dict[str, Any]]:
    """verl-format rows from one GSM8K jsonl file (``multiturn``: verl's tool-calling variant)."""
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path} (pass --input-dir with train.jsonl and test.jsonl)")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
                question, answer = example["question"], example["answer"]
                ground_truth = gsm8k_final_answer(answer)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: line {line_number}: not a GSM8K example ({type(exc).__name__}: {exc})") from exc
            index = len(rows)
            row = {
                "data_source": GSM8K_DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }
            if multiturn:
                row["prompt"] = [{"role": "system", "content": GSM8K_TOOL_SYSTEM}] + row["prompt"]
                row["agent_name"] = "tool_agent"
                row["extra_info"].update(need_tools_kwargs=True, tools_kwargs={
                    GSM8K_TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}})
            rows.append(row)
    return rows


def arithmetic_rows(num: int, split: str, rng: random.Random, max_operand: int, ops: list[str],
                    second_operand: int | None = None) -> list[dict[str, Any]]:
    """Random ``a <op> b`` questions with operands in ``0..max_operand`` (``b`` fixed to
    ``second_operand`` when given, e.g. 1 for "what comes next"); differences are never negative."""
    rows = []
    for index in range(num):
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand) if second_operand is None else second_operand
        op = rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        result = ARITHMETIC_OPS[op](a, b)
        rows.append({
            "data_source": ARITHMETIC_DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Answer with just the number."}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(result)},
            "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op},
        })
    return rows


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"wrote {len(rows)} rows to {path}", flush=True)


def prepare_gsm8k(input_dir: Path, output_dir: Path, multiturn: bool = False) -> dict[str, int]:
    counts = {}
    for split, out_name in (("train", "train.parquet"), ("test", "test.parquet")):
        source = input_dir / f"{split}.jsonl"
        print(f"reading {source}", flush=True)
        rows = gsm8k_rows(source, split, multiturn)
        write_parquet(rows, output_dir / out_name)
        counts[split] = len(rows)
    return counts


def prepare_arithmetic(output_dir: Path, num_train: int, num_test: int, seed: int, max_operand: int, ops: list[str],
                       second_operand: int | None = None) -> dict[str, int]:
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if unknown or not ops:
        raise ValueError(f"--ops {ops} has unknown operators {unknown}; choose from {list(ARITHMETIC_OPS)}")
    if max_operand < 0:
        raise ValueError(f"--max-operand must be >= 0, got {max_operand}")
    if second_operand is not None and second_operand < 0:
        raise ValueError(f"--second-operand must be >= 0, got {second_operand}")
    rng = random.Random(seed)
    counts = {}
    for split, num in (("train", num_train), ("test", num_test)):
        if num <= 0:
            raise ValueError(f"--num-{split} must be positive, got {num}")
        write_parquet(arithmetic_rows(num, split, rng, max_operand, ops, second_operand), output_dir / f"{split}.parquet")
        counts[split] = num
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megarl.data.prepare", description=__doc__.split("\n\n")[0])
    tasks = parser.add_subparsers(dest="task", required=True)

    gsm8k = tasks.add_parser("gsm8k", help="GSM8K jsonl -> verl parquet")
    gsm8k.add_argument("--input-dir", type=Path, default=None, help="folder with GSM8K's train.jsonl and test.jsonl "
                       f"(default: {DEFAULT_GSM8K_INPUT}, the repository's shared data, where it exists)")
    gsm8k.add_argument("--output-dir", type=Path, default=Path("~/data/gsm8k"), help="default ~/data/gsm8k")
    gsm8k.add_argument("--multiturn", action="store_true",
                       help="verl's tool-calling variant (agent_name=tool_agent, tools_kwargs for calc_gsm8k_reward)")

    arith = tasks.add_parser("arithmetic", help="synthetic 'What is a + b?' task")
    arith.add_argument("--output-dir", type=Path, default=Path("~/data/arithmetic"), help="default ~/data/arithmetic")
    arith.add_argument("--num-train", type=int, default=2000)
    arith.add_argument("--num-test", type=int, default=200)
    arith.add_argument("--seed", type=int, default=0)
    arith.add_argument("--max-operand", type=int, default=9, help="operands are drawn from 0..K (default 9)")
    arith.add_argument("--ops", default="+", help="comma-separated operators from + - * (default +)")
    arith.add_argument("--second-operand", type=int, default=None,
                       help="fix the second operand (e.g. 1: 'What is 6 + 1?'); default: random like the first")

    args = parser.parse_args(argv)
    output_dir = Path(os.path.expanduser(args.output_dir))
    if args.task == "gsm8k":
        input_dir = args.input_dir or DEFAULT_GSM8K_INPUT
        if args.input_dir is None and not DEFAULT_GSM8K_INPUT.is_dir():
            parser.error(f"gsm8k: pass --input-dir DIR, a folder with GSM8K's train.jsonl and test.jsonl (openai/"
                         f"grade-school-math, grade_school_math/data/); the default {DEFAULT_GSM8K_INPUT} exists only "
                         "in megarl's development layout")
        try:
            counts = prepare_gsm8k(Path(os.path.expanduser(input_dir)), output_dir, args.multiturn)
        except (FileNotFoundError, ValueError) as exc:  # a missing file, a bad line: named, no traceback
            parser.error(f"gsm8k: {exc}")
    else:
        ops = [op.strip() for op in args.ops.split(",") if op.strip()]
        counts = prepare_arithmetic(output_dir, args.num_train, args.num_test, args.seed, args.max_operand, ops,
                                    args.second_operand)
    print(f"{args.task}: " + ", ".join(f"{split}={n}" for split, n in counts.items()) + f" in {output_dir}", flush=True)


if __name__ == "__main__":
    main()
