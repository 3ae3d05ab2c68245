"""The in-process engine core of a TP=1 CPU replica (megarl/rollout/vllm/inproc_core.py) behaves as vLLM's own.

One subprocess (inproc_core_script.py) runs vLLM's synchronous engine as the reference, then ``AsyncLLM``
built as the replica builds it: the same seeded requests give the same tokens and log-probs; an abort ends
one request while another runs on; a collective RPC reaches a worker in the same process; a failing model
step fails the request in flight and marks the engine errored (the replica's health check then reports it
lost). The fleet tests run every other path (weight sync, LoRA, pooling, images, partial rollouts) on it.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("inproc")
    model = make_tiny_model("llama", "tiny", out_dir=root / "llama", seed=0)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    log_path, out = root / "script.log", root / "out.json"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("inproc_core_script.py")), str(out),
                                    str(model)], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = process.wait(timeout=270)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert returncode == 0, log_path.read_text()[-6000:]
    return json.loads(out.read_text())


def test_seeded_samples_equal_vllms_own_engine(result):
    assert len(result["samples"]) == len(result["reference"]) == 8
    for ours, theirs in zip(result["samples"], result["reference"]):
        assert ours["tokens"] == theirs["tokens"] and len(ours["tokens"]) == 12
        assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)


def test_an_abort_ends_one_request_while_another_finishes(result):
    assert 3 <= result["aborted_at"] < 200 and result["other_tokens"] == 12
    assert result["requests_left"] is False  # the aborted request left the scheduler


def test_the_worker_runs_in_the_replicas_process_and_utilities_answer(result):
    assert result["worker_pids"] == [result["pid"]]
    assert result["prefix_cache_reset"] is True


def test_a_failing_model_step_fails_the_request_and_marks_the_engine_errored(result):
    assert result["failure"]["raised"] is not None and result["failure"]["errored"] is True
