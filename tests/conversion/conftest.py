"""Fixtures for the conversion tests: tiny HF checkpoints and a runner for the conversion CLI.

``run_cli(args, nproc)`` runs ``python -m conversion ...`` (nproc 1) or the same under torchrun
(gloo, CPU), with OMP_NUM_THREADS=1 and a timeout, and returns the CompletedProcess.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.built_once import built_once
from tests.ports import run_ranks, torchrun

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gemma2", "kimi_k2", "qwen2_5_vl", "qwen3_vl")


def cli_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")


def cli_command(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "conversion", *args]
    return [*torchrun(nproc), "-m", "conversion", *args]


def run_cli(args: list[str], nproc: int = 1, timeout: int = 240) -> subprocess.CompletedProcess:
    """A conversion takes 10-15 s alone and took 64 s (and once more than 180 s) at the start of a CI run's
    heavy phase, beside the 2-rank bridge test; a launch that does not end gives its ranks' stacks (run_ranks)."""
    return run_ranks(cli_command([str(a) for a in args], nproc), env=cli_env(), cwd=REPO, timeout=timeout)


def assert_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """llama, qwen3, qwen3_moe, mixtral, deepseek_v3, gemma2, kimi_k2, qwen2_5_vl and qwen3_vl tiny checkpoints
    (noisy norms/biases; DeepSeek-V3 with a random router bias and an MTP layer; the VL ones with their vision
    towers and processors)."""
    from megarl.devtools.tiny_model import make_tiny_model

    def build(root: Path) -> Path:
        for family in FAMILIES:
            make_tiny_model(family, "tiny", root / family, seed=0)
        return root

    return built_once(tmp_path_factory, "tiny_models", build)


@pytest.fixture(scope="session")
def to_megatron(tiny_models, tmp_path_factory):
    """``to_megatron(family, flags, nproc)``: the family's ``hf-to-megatron`` output at that layout,
    converted once per session (by one of the xdist workers) and shared by the tests that only read it."""
    def convert(family: str, flags: tuple[str, ...] = (), nproc: int = 1) -> Path:
        def build(directory: Path) -> Path:
            out = directory / "mcore"
            assert_ok(run_cli(["hf-to-megatron", "--hf", tiny_models / family, "--out", out, *flags], nproc))
            return out

        return built_once(tmp_path_factory, "_".join([f"{family}_mcore", *flags]).replace("-", ""), build)

    return convert
