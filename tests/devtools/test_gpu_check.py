"""scripts/gpu_check.sh and its Python part, on the CPU: the logic of every section runs for real
(``--device cpu``, fp32, the small preset, the sync over CPU transports), and without CUDA the
default run skips every section. The wheels it carries match setup.py's pins."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def load_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy  # starts a process
def test_wheels_match_setup_pins():
    wheels = subprocess.run(["bash", str(SCRIPT), "--wheels"], capture_output=True, text=True, check=True).stdout.split()
    pins = {Requirement(w).name: Requirement(w) for w in wheels}
    assert set(pins) == {"megatron-core", "omegaconf", "antlr4-python3-runtime"}
    setup = (ROOT / "setup.py").read_text()
    for name in ("megatron-core", "omegaconf"):
        declared = Requirement(re.search(rf'"({name}[^"]*)"', setup).group(1))
        (version,) = [s.version for s in pins[name].specifier]
        assert declared.specifier.contains(version), f"{name}=={version} outside setup.py's {declared}"


def test_without_cuda_every_section_is_skipped(capsys):
    assert load_module().main([]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split("]")[0][1:] for line in lines] == ["logits", "train", "sync", "offload", "experts"]
    assert all("skipped: no CUDA" in line for line in lines), lines


def test_a_failing_section_is_reported_and_the_others_run(capsys, monkeypatch):
    module = load_module()
    monkeypatch.setitem(sys.modules, "megatron", None)  # megatron-core missing: a skip, not a failure
    monkeypatch.setitem(module.RUNNERS, "sync", lambda *a: 1 / 0)
    assert module.main(["--device", "cpu", "--only", "logits", "sync"]) == 1
    out = capsys.readouterr().out
    assert "[logits] skipped: megatron-core does not import" in out
    assert "[sync] FAILED: ZeroDivisionError" in out


@pytest.mark.heavy  # starts a process
def test_every_section_runs_on_cpu():
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "GPU_CHECK_BUDGET_S": "400"}
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--iters", "1", "--bucket-mb", "4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=420)
    lines = {line.split("]")[0][1:]: line for line in done.stdout.splitlines() if line.startswith("[")}
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert set(lines) == {"logits", "train", "sync", "offload", "experts"}
    engine = re.search(r"engine\[local\] float32 vs HF fp32: max (\S+)", lines["logits"])
    assert engine and float(engine.group(1)) < 1e-4, lines["logits"]
    assert "engine[transformer_engine]: skipped: no CUDA" in lines["logits"]
    assert re.search(r"tok/s, \S+ TFLOP/s; MFU vs measured matmul", lines["train"]), lines["train"]
    assert "cuda_ipc (host shared memory on CPU)" in lines["sync"] and "gloo" in lines["sync"], lines["sync"]
    assert "DIFFER" not in lines["sync"]
    for group in ("params", "grads", "optimizer"):
        assert f"{group} " in lines["offload"], lines["offload"]
    experts = re.search(r"experts\[local\] grouped vs sequential float32: log-probs max (\S+) mean", lines["experts"])
    assert experts and float(experts.group(1)) < 1e-5, lines["experts"]
    assert "experts[transformer_engine]: skipped: no CUDA" in lines["experts"]


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--only", "nothing"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        load_module().parse(argv)
