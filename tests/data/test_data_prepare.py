"""``python -m megarl.data.prepare``: GSM8K from the real files, and the arithmetic generator."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.data import PromptDataset
from megarl.data.prepare import main
from megarl.rewards import default_compute_score

REPO = Path(__file__).resolve().parents[2]
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(), reason=f"GSM8K files not found in {GSM8K_DIR}")
def test_prepare_gsm8k_real_files(tmp_path, capsys):
    main(["gsm8k", "--input-dir", str(GSM8K_DIR), "--output-dir", str(tmp_path)])
    assert "train=7473, test=1319" in capsys.readouterr().out

    for split, expected_count in (("train", 7473), ("test", 1319)):
        source = _jsonl(GSM8K_DIR / f"{split}.jsonl")
        rows = pq.read_table(tmp_path / f"{split}.parquet").to_pylist()
        assert len(rows) == len(source) == expected_count
        for i, (row, example) in enumerate(zip(rows, source)):
            # independent reference: the text after the last "####", commas removed
            ground_truth = example["answer"].split("####")[-1].strip().replace(",", "")
            assert row["reward_model"] == {"style": "rule", "ground_truth": ground_truth}
            assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
            assert row["prompt"] == [{"role": "user", "content": example["question"] + " " + INSTRUCTION}]
            assert row["extra_info"] == {"split": split, "index": i, "answer": example["answer"], "question": example["question"]}
    assert rows[0]["reward_model"]["ground_truth"] == "18"  # Janet's ducks


@pytest.mark.heavy  # starts a process
def test_prepare_arithmetic_via_cli(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megarl.data.prepare", "arithmetic", "--output-dir", str(tmp_path),
           "--num-train", "50", "--num-test", "10", "--seed", "4", "--ops", "+,-,*"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "train=50, test=10" in done.stdout

    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for split, count in (("train", 50), ("test", 10)):
        rows = pq.read_table(tmp_path / f"{split}.parquet").to_pylist()
        assert len(rows) == count
        for row in rows:
            content = row["prompt"][0]["content"]
            a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\? Answer with just the number\.", content).groups()
            assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
            assert row["reward_model"]["ground_truth"] == str(ops[op](int(a), int(b)))
            assert int(row["reward_model"]["ground_truth"]) >= 0
            assert row["data_source"] == "megarl/arithmetic"
            assert default_compute_score(row["data_source"], row["reward_model"]["ground_truth"], row["reward_model"]["ground_truth"]) == 1.0


def test_arithmetic_is_deterministic_and_loads(tmp_path, tokenizer):
    main(["arithmetic", "--output-dir", str(tmp_path / "a"), "--num-train", "20", "--num-test", "5", "--seed", "1"])
    main(["arithmetic", "--output-dir", str(tmp_path / "b"), "--num-train", "20", "--num-test", "5", "--seed", "1"])
    first = pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()
    assert first == pq.read_table(tmp_path / "b" / "train.parquet").to_pylist()
    dataset = PromptDataset(str(tmp_path / "a" / "train.parquet"), tokenizer, max_prompt_length=128)
    assert len(dataset) == 20 and dataset.num_filtered == 0


def test_gsm8k_without_input_dir_outside_the_repository_layout_says_what_to_pass(tmp_path, monkeypatch, capsys):
    """Installed elsewhere, the default input folder (the repository's shared data) does not exist: one usage error
    naming --input-dir and the two files, exit status 2, no traceback; a folder without the files is named too."""
    import megarl.data.prepare as prepare

    monkeypatch.setattr(prepare, "DEFAULT_GSM8K_INPUT", tmp_path / "no-shared-data")
    with pytest.raises(SystemExit) as info:
        main(["gsm8k", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "gsm8k: pass --input-dir DIR, a folder with GSM8K's train.jsonl and test.jsonl" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        main(["gsm8k", "--input-dir", str(tmp_path), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"GSM8K file not found: {tmp_path / 'train.jsonl'}" in err
