"""Fixtures for the conversion tests: tiny HF checkpoints and a runner for the conversion CLI.

``run_cli(args, nproc)`` runs ``python -m conversion ...`` under torchrun (nproc > 1, gloo, CPU) or,
for one process, the CLI's ``main`` in a process forked from this one (``fresh=True``: a new
``python -m conversion``), with OMP_NUM_THREADS=1 and a timeout, and returns a CompletedProcess.
A fork is a process of its own as a new one is (its torch.distributed, its exit code, its output)
without 3 s of importing torch, megatron-core and transformers again for each of ~25 calls;
the multi-rank conversions and the tests named "fresh processes" still start new interpreters.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def cli_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")


def cli_command(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "conversion", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "conversion", *args]


def run_cli(args: list[str], nproc: int = 1, timeout: int = 180, fresh: bool = False) -> subprocess.CompletedProcess:
    args = [str(a) for a in args]
    if nproc == 1 and not fresh and _fork_is_safe():
        return _run_forked(args, timeout)
    return subprocess.run(cli_command(args, nproc), env=cli_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _fork_is_safe() -> bool:
    """No process group or OpenMP pool of this process that a child would inherit half of."""
    import torch
    import torch.distributed as dist

    return sys.platform.startswith("linux") and not dist.is_initialized() and torch.get_num_threads() == 1


def _run_forked(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    import tempfile
    import time

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: conversion's main as ``python -m conversion`` would run it, then exit
            code = 70
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.chdir(REPO)
                import warnings

                warnings.simplefilter("ignore")
                from conversion.__main__ import main

                code = main(args)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(["conversion", *args], timeout)
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["conversion", *args], os.waitstatus_to_exitcode(status),
                                           out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def assert_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """llama, qwen3, qwen3_moe, mixtral, deepseek_v3, gemma2 and kimi_k2 tiny checkpoints (noisy
    norms/biases; DeepSeek-V3 with a random router bias and an MTP layer)."""
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    for family in ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gemma2", "kimi_k2"):
        make_tiny_model(family, "tiny", root / family, seed=0)
    return root


@pytest.fixture(scope="session")
def to_megatron(tiny_models, tmp_path_factory):
    """``to_megatron(family, flags, nproc)``: the family's ``hf-to-megatron`` output at that layout,
    converted once per session and shared by the tests that only read it."""
    done: dict = {}

    def convert(family: str, flags: tuple[str, ...] = (), nproc: int = 1) -> Path:
        key = (family, tuple(flags))
        if key not in done:
            out = tmp_path_factory.mktemp(f"{family}_mcore") / "mcore"
            assert_ok(run_cli(["hf-to-megatron", "--hf", tiny_models / family, "--out", out, *flags], nproc))
            done[key] = out
        return done[key]

    return convert
