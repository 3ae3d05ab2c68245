"""Bad input gives a clear error (exit 2) naming the problem; an interrupted write leaves no valid output."""
import json
import os
import shutil
import signal
import subprocess

import pytest

from tests.conversion.conftest import REPO, cli_command, cli_env, run_cli

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def llama_checkpoint(to_megatron):
    return to_megatron("llama", ("--tp", "2"), 2)


def assert_error(done, *phrases):
    assert done.returncode == 2, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    for phrase in phrases:
        assert phrase in done.stderr, done.stderr


def test_truncated_safetensors_file(tiny_models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models / "llama", broken)
    weights = broken / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    done = run_cli(["hf-to-megatron", "--hf", broken, "--out", tmp_path / "out"])
    assert_error(done, "model.safetensors is truncated")
    assert not (tmp_path / "out").exists()


def test_unknown_architecture(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    done = run_cli(["hf-to-megatron", "--hf", model, "--out", tmp_path / "out"])
    assert_error(done, "no megatron bridge", "GPT2LMHeadModel")


def test_wrong_hf_config_family(tiny_models, llama_checkpoint, tmp_path):
    done = run_cli(["megatron-to-hf", "--checkpoint", llama_checkpoint, "--hf-config", tiny_models / "qwen3_moe",
                    "--out", tmp_path / "out"])
    assert_error(done, "does not match --hf-config", "not in the checkpoint")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_missing_checkpoint_dir(tiny_models, tmp_path):
    done = run_cli(["megatron-to-hf", "--checkpoint", tmp_path / "nowhere", "--hf-config", tiny_models / "llama",
                    "--out", tmp_path / "out"])
    assert_error(done, "nowhere does not exist")


def test_missing_hf_dir(tmp_path):
    assert_error(run_cli(["hf-to-megatron", "--hf", tmp_path / "nowhere", "--out", tmp_path / "out"]), "does not exist")


def test_existing_output_is_refused_without_overwrite(tiny_models, llama_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    done = run_cli(["megatron-to-hf", "--checkpoint", llama_checkpoint, "--hf-config", tiny_models / "llama", "--out", out])
    assert_error(done, "already exists", "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"


def test_wrong_process_count_prints_the_torchrun_command(tiny_models, tmp_path):
    done = run_cli(["hf-to-megatron", "--hf", tiny_models / "llama", "--out", tmp_path / "out", "--tp", "2"])
    assert_error(done, "torchrun --standalone --nproc-per-node 2 -m conversion hf-to-megatron")


def test_interrupted_write_leaves_no_valid_output(tiny_models, tmp_path):
    out = tmp_path / "mcore"
    process = subprocess.Popen(cli_command(["hf-to-megatron", "--hf", str(tiny_models / "llama"), "--out", str(out)]),
                               env=cli_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    try:
        for line in process.stdout:  # kill once the weights are loaded, while the checkpoint is being written
            if line.startswith("[2/3]"):
                break
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    assert not out.exists()
    done = run_cli(["megatron-to-hf", "--checkpoint", f"{out}.tmp", "--hf-config", tiny_models / "llama",
                    "--out", tmp_path / "hf"])
    assert done.returncode == 2 and ("not a complete" in done.stderr or "does not exist" in done.stderr), done.stderr
