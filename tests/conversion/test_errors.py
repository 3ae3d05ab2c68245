"""Bad input gives a clear error (exit 2) naming the problem; an interrupted write leaves no valid output."""
import json
import os
import shutil
import signal
import subprocess

import pytest

from tests.conversion.conftest import REPO, cli_command, cli_env, run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]  # the conversion CLI in subprocesses


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


class RunsCode:
    """Unpickled, it runs ``touch MARKER``: what a crafted checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_whose_metadata_would_run_code_is_refused(to_megatron, tiny_models, tmp_path):
    """A valid ``.metadata`` with a payload inside (its manifest rewritten, as an attacker would): the
    conversion and verify refuse it naming the file, and the payload does not run."""
    import pickle

    from megarl.engine.manifest import write_manifest

    crafted = tmp_path / "crafted"
    shutil.copytree(to_megatron("llama"), crafted)
    step, marker = crafted / "step_0", tmp_path / "marker"
    metadata = pickle.loads((step / ".metadata").read_bytes())  # our own conversion output
    metadata.storage_meta.modules = [RunsCode(marker)]
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(step)
    for command in (["megatron-to-hf", "--checkpoint", crafted, "--hf-config", tiny_models / "llama", "--out", tmp_path / "out"],
                    ["verify", "--hf", tiny_models / "llama", "--megatron", crafted]):
        assert_error(run_cli(command), f"{step / '.metadata'}: refused to load (it asks for posix.system)")
        assert not marker.exists(), f"{command[0]} ran the checkpoint's code"
    assert not (tmp_path / "out").exists()


def test_a_damaged_or_truncated_checkpoint_file_is_named(to_megatron, tiny_models, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(to_megatron("llama"), damaged)
    step = damaged / "step_0"
    size = (step / "common.pt").stat().st_size
    original = (step / "common.pt").read_bytes()
    os.truncate(step / "common.pt", size - 10)
    convert = ["megatron-to-hf", "--checkpoint", damaged, "--hf-config", tiny_models / "llama", "--out", tmp_path / "out"]
    assert_error(run_cli(convert), f"checkpoint {step} is damaged: common.pt has {size - 10} bytes, the manifest "
                                   f"records {size} (truncated or overwritten)")
    (step / "common.pt").write_bytes(original)
    data = step / "__0_0.distcp"
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # same size: only the checksum tells
    data.write_bytes(bytes(flipped))
    assert_error(run_cli(convert), f"checkpoint {step} is damaged: __0_0.distcp has the recorded size but another sha256")
    assert not (tmp_path / "out").exists()
