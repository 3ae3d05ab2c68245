"""What a run says about itself: the summary, the interrupt report, finished runs, samples and the hint."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from megarl.engine.batch import RLBatch
from megarl.run.interrupts import (Interrupted, InterruptGuard, checkpoint_step, finished_run,
                                       interrupt_report)
from megarl.trainer.rollout_batch import StepData
from megarl.run.summary import RunSummary, places
from megarl.run.samples import SampleReporter, dump_generations, first_samples

REPO = Path(__file__).resolve().parents[2]


def step_metrics(gen: float, update: float, sync: float, step: float, tokens: float = 1000.0) -> dict:
    return {"timing_s/gen": gen, "timing_s/reward": 0.001, "timing_s/old_log_prob": 1.0, "timing_s/update_actor": update,
            "timing_s/sync": sync, "timing_s/wake": 0.0, "timing_s/adv": 0.002, "timing_s/step": step,
            "timing_per_token_ms/gen": 1000.0 * gen / 200, "perf/total_num_tokens": tokens}


def test_summary_splits_the_time_by_phase_and_names_the_outputs(tmp_path):
    summary = RunSummary(total_steps=10)
    summary.seconds["start-up"] = 20.0
    summary.add_history([{"step": 0, "val/score": 0.1}, {"step": 5, "critic/score/mean": 0.3}])
    for step in (6, 7):
        summary.record_step(step, step_metrics(gen=4.0, update=3.0, sync=1.0, step=10.0))
    summary.record_validation(7, 0.6)
    summary.record_validation(6, 0.7)
    lines = summary.lines(places(tmp_path, ["console", "tensorboard"], tmp_path / "actor" / "step_7",
                                 [tmp_path / "val_generations.jsonl"], tmp_path / "reward_curve.png", tmp_path / "logs"))
    assert lines[0].startswith("done: steps 6-7 of 10 in ") and "start-up 20 s (" in lines[0] and "training 20 s (" in lines[0]
    # reward (0.002 s) and adv fold into other; ref and values never ran
    assert lines[1] == ("  step time by phase: gen 8.0 s (40%) | old_log_prob 2.0 s (10%) | update 6.0 s (30%) | "
                        "sync 2.0 s (10%) | other 2.0 s (10%)")
    assert lines[2] == ("  throughput: 100 tokens/s (prompt + response tokens over the steps' time, all devices); "
                        "50 response tokens/s while generating")
    assert lines[3] == "  validation score: best 0.700 at step 6, final 0.600 at step 7 (0.100 at step 0)"
    assert lines[4].startswith(f"  TensorBoard: {tmp_path / 'tensorboard'} (tensorboard --logdir {tmp_path}")
    assert f"  checkpoint: {tmp_path / 'actor' / 'step_7'} (the latest)" in lines
    assert not any(line.startswith("  samples") for line in lines)  # the file does not exist
    assert lines[-1] == f"  logs: {tmp_path / 'logs'}/ (driver.log and one file per worker)"


def fake_checkpoint(root: Path, step: int) -> Path:
    path = root / "actor" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "megarl_checkpoint.json").write_text(json.dumps({"contents": ["model"]}))
    (root / "actor" / "latest").write_text(f"step_{step}")
    return path


def trainer_cfg(root: Path, **values):
    return OmegaConf.create({"default_local_dir": str(root), "resume_mode": "auto", "resume_from_path": None,
                             "save_freq": 5, "val_only": False, **values})


def test_interrupt_report_and_finished_runs(tmp_path):
    exc = Interrupted(signal.SIGTERM)
    exc.step, exc.total_steps = 7, 20
    assert exc.exit_code == 143 and isinstance(exc, KeyboardInterrupt)
    assert interrupt_report(trainer_cfg(tmp_path), exc) == (
        "interrupted (SIGTERM) at step 7 of 20; no checkpoint yet (trainer.save_freq=5): the same command starts over")
    path = fake_checkpoint(tmp_path, 5)
    assert interrupt_report(trainer_cfg(tmp_path), exc) == (
        f"interrupted (SIGTERM) at step 7 of 20; last checkpoint: step 5 at {path}; the same command resumes")
    exc.step = 0
    assert interrupt_report(trainer_cfg(tmp_path, resume_mode="disable"), exc).startswith(
        "interrupted (SIGTERM) during start-up; last checkpoint: step 5 at ")
    assert finished_run(trainer_cfg(tmp_path), tmp_path, total_steps=6) is None
    assert finished_run(trainer_cfg(tmp_path), tmp_path, total_steps=5) == (5, path)
    assert finished_run(trainer_cfg(tmp_path, resume_mode="disable"), tmp_path, total_steps=5) is None
    assert finished_run(trainer_cfg(tmp_path, val_only=True), tmp_path, total_steps=5) is None
    assert checkpoint_step(path) == 5 and checkpoint_step(tmp_path) is None


def test_first_signal_raises_in_the_main_thread():
    before = signal.getsignal(signal.SIGINT)  # pytest's default, or what an earlier test's Ray left
    guard = InterruptGuard().install()
    try:
        with pytest.raises(Interrupted) as raised:
            os.kill(os.getpid(), signal.SIGINT)
        assert raised.value.signum == signal.SIGINT and guard.received == signal.SIGINT
        # Ray's get() re-raises the signal as a plain KeyboardInterrupt: it stands for the same interrupt
        assert guard.interrupted(raised.value) is raised.value
        assert guard.interrupted(KeyboardInterrupt()).signum == signal.SIGINT
    finally:
        guard.restore()
    assert signal.getsignal(signal.SIGINT) is before  # restore puts back what was there
    interrupted_task = logging.LogRecord("asyncio", logging.ERROR, "x", 1, "Task exception was never retrieved", (),
                                         (Interrupted, raised.value, None))
    assert not logging.getLogger("asyncio").filter(interrupted_task)  # the interrupt, not a failure


@pytest.mark.heavy  # starts a process
def test_second_signal_kills_the_processes_at_once(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        from megarl.run.interrupts import Interrupted, InterruptGuard
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(tmp_path / 'child')!r}, "w").write(str(child.pid))
        guard = InterruptGuard(on_kill=lambda: open({str(tmp_path / 'killed')!r}, "w").close()).install()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except Interrupted:
            time.sleep(1.5)  # a second signal sooner than 1 s is the first one sent twice (timeout's pid + group)
            os.kill(os.getpid(), signal.SIGINT)  # during the teardown
            time.sleep(5)
        print("not reached")
    """)
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 130 and "not reached" not in result.stdout, result
    assert "SIGINT again: killing the run's processes" in result.stderr
    child = int((tmp_path / "child").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    assert (tmp_path / "killed").exists()


@pytest.mark.heavy  # starts a process
def test_sigterm_to_the_driver_then_to_its_group_is_one_interrupt(tmp_path):
    """GNU timeout (and other supervisors) send SIGTERM to the driver, then to its whole process group:
    when the driver's handler has run between the two (a busy machine), it gets a second SIGTERM
    milliseconds after the first. That is one interrupt: the teardown runs to its end (the resume line),
    instead of the hard kill a real second interrupt gets."""
    script = textwrap.dedent("""
        import sys, time
        from megarl.run.interrupts import Interrupted, InterruptGuard
        guard = InterruptGuard().install()
        try:
            print("ready", flush=True)
            time.sleep(60)
        except Interrupted as exc:
            time.sleep(0.5)  # the teardown, during which the group's copy of the signal arrives
            print("torn down", flush=True)
            sys.exit(exc.exit_code)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)  # to the driver ...
        assert "SIGTERM: stopping the engines and workers" in proc.stderr.readline() + proc.stderr.readline()
        os.killpg(proc.pid, signal.SIGTERM)  # ... then to its process group, once its handler has run
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out == "torn down\n" and proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err)
    assert "SIGTERM again" not in err, err


@pytest.mark.heavy  # starts a process
def test_what_the_interrupted_code_leaves_behind_stays_off_the_console(tmp_path):
    script = textwrap.dedent("""
        import os, signal
        from megarl.run.interrupts import Interrupted, InterruptGuard

        class HalfBuilt:  # as asyncio's event loop, interrupted in __init__: its __del__ fails
            def __init__(self):
                os.kill(os.getpid(), signal.SIGINT)
                self.pipe = 1
            def __del__(self):
                self.pipe

        async def never_awaited():
            pass

        guard = InterruptGuard().install()
        pending = never_awaited()
        try:
            HalfBuilt()
        except Interrupted:
            print("interrupted")
        del pending
    """)
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "interrupted\n", result
    assert "stopping the engines and workers" in result.stderr
    for noise in ("Exception ignored", "Traceback", "never awaited"):
        assert noise not in result.stderr, result.stderr


def step_data(scores, responses, finish="stop") -> StepData:
    n = len(scores)
    ids = torch.ones(n, 3, dtype=torch.long)
    return StepData(RLBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(n, 1)), {
        "uid": [f"1:{i // 2}" for i in range(n)], "prompt_text": [f"What is {i // 2} + 1?" for i in range(n)],
        "response_text": list(responses), "ground_truth": [str(i // 2 + 1) for i in range(n)],
        "data_source": ["megarl/arithmetic"] * n, "extra_info": [None] * n, "finish_reason": [finish] * n,
        "score": torch.tensor(scores, dtype=torch.float32), "acc": [s > 0 for s in scores]})


def test_dumps_have_verls_fields_and_train_samples_take_one_per_prompt(tmp_path):
    data = step_data([1.0, 0.0, 0.0, 0.0], ["1", "x", "y", "z"])
    path = dump_generations(tmp_path / "dumps", 3, data, ["acc", "not_a_field"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.name == "3.jsonl" and len(rows) == 4
    assert rows[0] == {"input": "What is 0 + 1?", "output": "1", "gts": "1", "score": 1.0, "step": 3, "acc": True}
    assert first_samples(data, 5) == [
        {"prompt": "What is 0 + 1?", "response": "1", "ground_truth": "1", "score": 1.0},
        {"prompt": "What is 1 + 1?", "response": "y", "ground_truth": "2", "score": 0.0}]


class _Logger:
    def __init__(self):
        self.generations = []

    def log_generations(self, samples, step, title, file_name):
        self.generations.append((step, title, file_name, samples))


def reporter_cfg(tmp_path, **trainer):
    return OmegaConf.create({
        "trainer": {"rollout_data_dir": None, "validation_data_dir": None, "log_train_generations": 1,
                    "log_train_generations_freq": 2, "default_local_dir": str(tmp_path), **trainer},
        "custom_reward_function": {"path": None, "name": "compute_score"},
        "algorithm": {"adv_estimator": "grpo"}, "critic": {"enable": None},
        "actor_rollout_ref": {"rollout": {"response_length": 8}}})


def test_reporter_logs_train_samples_every_k_steps_and_hints_once_at_constant_zero(tmp_path, caplog):
    from megarl.rewards import RewardManager

    caplog.set_level(logging.INFO, logger="megarl.console")
    logger = _Logger()
    reporter = SampleReporter(reporter_cfg(tmp_path, rollout_data_dir=str(tmp_path / "r")), logger, RewardManager())
    for step in (1, 2, 3):
        reporter.on_train_step(step, step_data([0.0] * 4, ["no", "idea", "at", "all"]), ["acc"])
    assert [(s, t, f) for s, t, f, _ in logger.generations] == [(2, "train/generations", "train_generations.jsonl")]
    hints = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hint:")]
    assert len(hints) == 1 and hints[0].startswith("hint: every reward of steps 1-2 is 0 (8 samples)")
    assert "gives 1 to the bare answer '1': the responses are wrong" in hints[0]  # the arithmetic rule reads numbers
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    caplog.clear()
    varied = SampleReporter(reporter_cfg(tmp_path), logger, RewardManager())
    varied.on_train_step(1, step_data([0.0, 1.0, 0.0, 0.0], ["x", "1", "y", "z"]), [])
    varied.on_train_step(2, step_data([0.0] * 4, ["x", "y", "z", "w"]), [])
    assert not any(r.getMessage().startswith("hint:") for r in caplog.records)
