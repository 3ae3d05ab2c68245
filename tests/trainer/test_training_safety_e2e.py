"""Fault injection into real runs (``megarl train``, the quickstart's tiny model on CPU): a run whose
gradients or weights go non-finite stops with status 1 and says why, and writes no checkpoint with
non-finite weights. The runs generate with the ``hf`` rollout backend: the checks are the trainer's, before
any weight reaches a replica of either backend.

1. ``optim.lr=1e3``: the first optimizer step makes the weights huge (still finite), every later
   gradient is NaN, megatron's optimizer skips those steps; before, the run went on to "done" with
   11 of 12 optimizer steps skipped. Now it stops after ``trainer.max_consecutive_skipped_steps``
   (3) training steps in a row, and every checkpoint it wrote (one per step) is finite.
2. The actor starts from a megatron checkpoint holding a NaN (converted from an HF model with one
   NaN weight): the weight check refuses the start-up sync to the fleet, naming the parameter.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inputs(quickstart_inputs):
    return quickstart_inputs  # tests/conftest.py: built once per session


def train(inputs, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megarl.run.train", "--config-name", "quickstart",
               f"data.train_files={inputs['data'] / 'train.parquet'}", f"data.val_files={inputs['data'] / 'test.parquet'}",
               f"actor_rollout_ref.model.path={inputs['model']}", "trainer.total_training_steps=8", "trainer.save_freq=1",
               "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.default_local_dir={out}",
               "actor_rollout_ref.rollout.name=hf", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of a megatron dist checkpoint (model and optimizer state)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path.parent / f"{path.name}.pt"))
    found: dict[str, torch.Tensor] = {}

    def walk(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif torch.is_tensor(value) and value.is_floating_point():
                found[prefix + key] = value

    walk(torch.load(path.parent / f"{path.name}.pt", weights_only=False))
    return found


@pytest.mark.timeout(900)
def test_a_learning_rate_that_diverges_stops_the_run_and_every_checkpoint_is_finite(inputs, tmp_path):
    out = tmp_path / "lr"
    done = train(inputs, out, "actor_rollout_ref.actor.optim.lr=1e3")
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-5000:]
    stopped = re.search(r"^error: training stopped at step (\d+): the actor's optimizer skipped every step of 3 training "
                        r"steps in a row \(steps (\d+)-\1; trainer.max_consecutive_skipped_steps=3\) because its "
                        r"gradients are not finite \(inf/NaN\), \d+ of \d+ optimizer steps since the start. Look at "
                        r"the learning rate \(actor_rollout_ref.actor.optim.lr=1000.0\)", output, re.M)
    assert stopped and int(stopped.group(1)) == int(stopped.group(2)) + 2, output[-5000:]  # seen: steps 2-4, 7 of 8
    last = int(stopped.group(1))
    assert f"Last checkpoint: step {last - 1} at" in output and "done:" not in output
    saved = sorted((out / "actor").glob("step_*"), key=lambda p: int(p.name[5:]))
    assert [p.name for p in saved] == [f"step_{i}" for i in range(1, last)]  # one per step, none after the stop
    for path in saved:
        tensors = checkpoint_tensors(path)
        assert any(name.startswith("embedding") for name in tensors), sorted(tensors)[:5]
        bad = [name for name, value in tensors.items() if not torch.isfinite(value).all()]
        assert not bad, f"{path} holds non-finite tensors: {bad}"


@pytest.mark.timeout(900)
def test_a_start_checkpoint_with_a_nan_is_never_synced(inputs, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf_nan"
    hf.mkdir()
    for file in Path(inputs["model"]).iterdir():
        (hf / file.name).write_bytes(file.read_bytes())
    weights = load_file(hf / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    converted = subprocess.run([sys.executable, "-m", "conversion", "hf-to-megatron", "--hf", str(hf), "--out",
                                str(tmp_path / "mcore")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]

    out = tmp_path / "nan"
    done = train(inputs, out, f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={tmp_path / 'mcore'}")
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-5000:]
    assert (f"error: refusing to sync the weights of {tmp_path / 'mcore'} to the rollout fleet: the actor's weights "
            "hold non-finite values (inf/NaN), first in decoder.layers.1.mlp.linear_fc1.weight (trainer rank 0: "
            "pipeline stage 0, tensor rank 0), 1 tensor(s) in all; nothing was synced or saved.") in output, output[-5000:]
    assert "step 1 |" not in output and not (out / "actor").exists()
