"""A checkpoint is checked before it is trusted (one process, gloo; ``_checkpoint_worker.py``):

* same-size damage to the optimizer's master weights is named at load, before any state changes;
* a ``.metadata``, a ``common.pt`` or an RNG object whose unpickling would run code is refused,
  naming the file, and the code does not run;
* a checkpoint without a manifest (saved before them) still loads, with a note;
* on small tmpfs mounts: a save that cannot fit is refused before writing, the previous checkpoint
  intact, and a save that runs out of space mid-write says so and leaves nothing behind;
* saving leaves no helper process running (megatron's default spawns a ``multiprocessing.Manager``).
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _engine_launch import ENV

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("_checkpoint_worker.py")


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory):
    """``mount(size)``: a fresh tmpfs of ``size`` (unmounted at teardown); skips if mounting is impossible."""
    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path_factory.mktemp(f"tmpfs_{size}")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the full-disk cases need one")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


@pytest.fixture(scope="module")
def integrity(engine_work, tmpfs):
    # the tiny model's checkpoint (weights and Adam state) takes 5.8 MB: room for one, and for less than one
    roomy, small = tmpfs("9m"), tmpfs("2m")
    done = subprocess.run([sys.executable, str(WORKER), str(engine_work), str(roomy), str(small)], env=ENV,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"worker failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    return torch.load(engine_work / "checkpoint_integrity.pt", weights_only=False)


def test_same_size_damage_is_named_before_anything_loads(integrity):
    result = integrity["damaged"]
    assert result["load"]["error"] == "CheckpointIntegrityError", result
    assert f"{result['file']} has the recorded size but another sha256" in result["load"]["message"]
    assert result["untouched"], "a refused load changed the model"
    assert "returned" in result["repaired_load"] and result["restored"]
    assert {".metadata", "common.pt", "megarl_checkpoint.json", result["file"]} <= set(result["manifest_files"])


@pytest.mark.parametrize("kind, file", [("metadata", "crafted_metadata/.metadata"), ("common", "crafted_common/common.pt"),
                                        ("rng", "step_2/__0_0.distcp (object megarl.rng_state/")])
def test_checkpoints_that_would_run_code_are_refused(integrity, kind, file):
    result = integrity["crafted"][kind]
    assert result.get("error") == "UnsafeCheckpointError", result
    assert file in result["message"] and "refused to load (it asks for posix.system)" in result["message"]
    assert integrity["crafted"]["markers"] == []  # no payload ran


def test_a_checkpoint_from_before_manifests_loads_with_a_note(integrity):
    result = integrity["legacy"]
    assert "returned" in result["load"], result
    assert len(result["notes"]) == 1 and "has no megarl_manifest.json" in result["notes"][0]
    assert "cannot be verified" in result["notes"][0]


def test_a_save_that_cannot_fit_is_refused_and_the_previous_checkpoint_stays(integrity):
    result = integrity["full_disk"]
    assert "returned" in result["first"], result
    assert result["second"]["error"] == "CheckpointSpaceError", result
    message = result["second"]["message"]
    assert message.startswith("No space left for checkpoint step 2:") and "the previous checkpoint" in message
    assert "step_1 is intact" in message
    assert result["roomy_after"] == ["latest", "step_1"] and result["latest"] == "step_1"
    assert "returned" in result["reload"]


def test_a_save_that_fills_the_disk_says_so(integrity):
    result = integrity["full_disk"]["into_small"]
    assert result.get("error") == "CheckpointSpaceError", result
    assert "No space left on device while writing" in result["message"] and "step_1.tmp" in result["message"]
    assert "there is no earlier one" in result["message"]
    assert integrity["full_disk"]["small_after"] == []  # the partial checkpoint was removed


def test_saves_leave_no_helper_process_running(integrity):
    """After four saves: megatron's writer would keep a spawned ``SyncManager`` process for its results queue."""
    assert integrity["helpers_alive"] == []
