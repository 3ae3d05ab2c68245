"""The run as a person sees it: ``megarl train`` in a subprocess, on a tiny model, as a user starts it.

One 6-step run serves every check, in four launches of the same command:

1. interrupted with SIGINT to its process group (a terminal's Ctrl-C) after its step-2 checkpoint:
   fewer than 20 lines before the first step, no dependency warning twice, the zero-reward hint
   (the reward function wants ``\\boxed{}``, which neither the prompts nor the random model write),
   then the resume hint, no process of the run left (by pid and by process group) and no temp dir;
2. the same command, sent SIGTERM (to the driver only, as ``kill`` does) while its engines start:
   the same report and clean-up;
3. the same command resumes; SIGTERM reaches its driver (sent by the reward function, so it lands
   inside the first step it runs): that step ends, is checkpointed (not a ``save_freq`` step), and the
   run stops with 143 and the usual report (``trainer.save_on_preempt``);
4. the same command resumes from that checkpoint and finishes, with the summary; the sample files
   (train and validation generations, verl's rollout and validation dumps) have their fields;
   the worker logs exist, with vLLM's engine log, and the silenced vLLM reload warning is not in them;
5. the same command again says the run has finished, before any engine starts.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BOXED_REWARD = r'''
import os
import re
import signal
from pathlib import Path

SIGTERM_DRIVER = Path(__file__).with_name("sigterm_driver")  # the driver's pid, written by the test: SIGTERM it once


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    try:
        os.rename(SIGTERM_DRIVER, SIGTERM_DRIVER.with_suffix(".sent"))  # atomic: one call of the step sends it
    except FileNotFoundError:
        pass
    else:
        os.kill(int(SIGTERM_DRIVER.with_suffix(".sent").read_text()), signal.SIGTERM)
    found = re.findall(r"\\boxed\{([^}]*)\}", solution_str)
    return 1.0 if found and found[-1].strip() == str(ground_truth) else 0.0
'''
TOTAL = 6


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    from megarl.data.prepare import prepare_arithmetic
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("console")
    model = make_tiny_model("llama", "tiny", root / "model", seed=0)
    prepare_arithmetic(root / "data", num_train=64, num_test=8, seed=0, max_operand=8, ops=["+"], second_operand=1)
    (root / "reward.py").write_text(BOXED_REWARD)
    (root / "tmp").mkdir()
    command = [sys.executable, "-m", "megarl.run.train", "--config-name", "quickstart",
               f"data.train_files={root / 'data' / 'train.parquet'}", f"data.val_files={root / 'data' / 'test.parquet'}",
               "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
               f"actor_rollout_ref.model.path={model}", f"custom_reward_function.path={root / 'reward.py'}",
               f"trainer.total_training_steps={TOTAL}", "trainer.save_freq=2", "trainer.test_freq=3",
               "trainer.log_val_generations=2", "trainer.log_train_generations=2", "trainer.log_train_generations_freq=2",
               f"trainer.rollout_data_dir={root / 'rollouts'}", f"trainer.validation_data_dir={root / 'validations'}",
               f"trainer.default_local_dir={root / 'run'}"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "TMPDIR": str(root / "tmp")}

    def start() -> subprocess.Popen:
        return subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)

    return root, start


def read_until(proc: subprocess.Popen, pattern: str, lines: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if re.search(pattern, line):
            return
        assert time.monotonic() < deadline, f"no line matching {pattern!r} within {timeout_s} s:\n" + "\n".join(lines)
    pytest.fail(f"the run ended before a line matching {pattern!r}:\n" + "\n".join(lines))


def finish(proc: subprocess.Popen, lines: list[str], timeout_s: float) -> int:
    lines += [line.rstrip("\n") for line in proc.stdout]
    return proc.wait(timeout=timeout_s)


def warnings_shown_twice(lines: list[str]) -> list[str]:
    seen, twice = set(), []
    for line in lines:
        if re.search(r"warning", line, re.IGNORECASE) and not line.startswith(("hint:", "  ")):
            key = re.sub(r"\d+", "#", line)
            if key in seen:
                twice.append(line)
            seen.add(key)
    return twice


def group_members(pgid: int) -> list[int]:
    members = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def assert_nothing_left(proc: subprocess.Popen, run_processes: list, root: Path) -> None:
    """No process of the run (by pid and by process group), no Ray temp dir, nothing in TMPDIR."""
    _, alive = psutil.wait_procs(run_processes, timeout=30)
    assert not alive, f"left running after the interrupt: {[p.pid for p in alive]}"
    assert not group_members(proc.pid), "processes of the run's process group are left"
    ray_tmp = re.findall(r"temp dir (/\S+)\)", (root / "run" / "logs" / "driver.log").read_text())[-1]
    assert not Path(ray_tmp).exists(), f"Ray's temp dir {ray_tmp} is left"
    assert not list((root / "tmp").iterdir()), f"temp files left: {list((root / 'tmp').iterdir())}"


@pytest.mark.timeout(900)
def test_interrupts_resume_and_a_finished_run(launch):
    root, start = launch
    run_dir = root / "run"

    # 1. interrupted after the step-2 checkpoint
    began = time.monotonic()
    proc, lines = start(), []
    read_until(proc, r"^checkpoint step 2: ", lines, timeout_s=420)
    # a step takes 0.1 s: interrupted right after the checkpoint line, the run may not have begun step 3 yet;
    # after step 3's line it is past the checkpoint (the next one, after step 4, takes seconds to write)
    read_until(proc, r"^step 3 \|", lines, timeout_s=120)
    run_processes = psutil.Process(proc.pid).children(recursive=True)
    assert len(run_processes) >= 4, "Ray's daemons, the trainer rank and the vLLM engine should be running"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rc = finish(proc, lines, timeout_s=180)
    output = "\n".join(lines)
    print(f"interrupted run: {time.monotonic() - began:.0f} s\n{output}")
    assert rc == 128 + signal.SIGINT, output
    assert "Traceback" not in output, output
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1 |"))
    assert first_step < 20, f"{first_step} lines before the first step:\n" + "\n".join(lines[:first_step])
    assert not warnings_shown_twice(lines), warnings_shown_twice(lines)
    assert re.search(r"^suppressed \d+ known dependency warnings \(.*megatron TE/Apex fallback x\d+", output, re.M)
    hint = output[output.index("hint: every reward of steps 1-2 is 0"):]
    assert r"the reward function expects \boxed{...}" in hint and r"no response contains '\boxed'" in hint
    assert "the prompts never ask for it" in hint
    report = re.search(r"^interrupted \(SIGINT\) at step (\d+) of 6; last checkpoint: step (\d+) at (\S+); "
                       r"the same command resumes$", output, re.M)
    assert report, output
    stopped_at, saved = int(report.group(1)), int(report.group(2))
    assert stopped_at > saved >= 2 and Path(report.group(3)) == run_dir / "actor" / f"step_{saved}"
    assert_nothing_left(proc, run_processes, root)

    # 2. SIGTERM while the engines start
    began = time.monotonic()
    proc, lines = start(), []
    read_until(proc, r"^Ray cluster: ", lines, timeout_s=300)
    run_processes = psutil.Process(proc.pid).children(recursive=True)
    time.sleep(3)  # into the trainer's start-up
    run_processes += psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    rc = finish(proc, lines, timeout_s=180)
    output = "\n".join(lines)
    print(f"terminated run: {time.monotonic() - began:.0f} s\n{output}")
    assert rc == 128 + signal.SIGTERM and "Traceback" not in output, output
    assert (f"interrupted (SIGTERM) during start-up; last checkpoint: step {saved} at "
            f"{run_dir / 'actor' / f'step_{saved}'}; the same command resumes") in output
    assert_nothing_left(proc, run_processes, root)

    # 3. the same command resumes; SIGTERM during its first step: that step is saved, then the run stops
    began = time.monotonic()
    proc, lines = start(), []
    (root / "sigterm_driver").write_text(str(proc.pid))  # the reward function's first call sends it
    rc = finish(proc, lines, timeout_s=420)
    output = "\n".join(lines)
    print(f"preempted run: {time.monotonic() - began:.0f} s\n{output}")
    preempted = saved + 1
    assert rc == 128 + signal.SIGTERM and "Traceback" not in output, output
    assert (root / "sigterm_driver.sent").exists() and f"resumed from {run_dir / 'actor' / f'step_{saved}'}" in output
    assert "SIGTERM: saving a checkpoint when the step in progress ends, then stopping" in output
    assert re.search(rf"^step {preempted} \|", output, re.M) and not re.search(rf"^step {preempted + 1} \|", output, re.M)
    assert re.search(rf"^checkpoint step {preempted}: {run_dir / 'actor' / f'step_{preempted}'} ", output, re.M), output
    assert f"SIGTERM: stopping after the checkpoint of step {preempted}" in output
    assert (f"interrupted (SIGTERM) at step {preempted} of 6; last checkpoint: step {preempted} at "
            f"{run_dir / 'actor' / f'step_{preempted}'}; the same command resumes") in output
    assert (run_dir / "actor" / "latest").read_text().strip() == f"step_{preempted}"

    # 4. the same command resumes from the preemption's checkpoint and finishes
    began = time.monotonic()
    proc, lines = start(), []
    rc = finish(proc, lines, timeout_s=420)
    output = "\n".join(lines)
    print(f"resumed run: {time.monotonic() - began:.0f} s\n{output}")
    assert rc == 0 and "Traceback" not in output, output
    assert f"resumed from {run_dir / 'actor' / f'step_{preempted}'}" in output
    assert re.search(rf"^done: steps {preempted + 1}-6 of 6 in ", output, re.M), output
    assert "step time by phase: gen " in output and "validation score: best 0.000" in output
    assert not warnings_shown_twice(lines), warnings_shown_twice(lines)
    train = [json.loads(line) for line in (run_dir / "train_generations.jsonl").read_text().splitlines()]
    assert {s["step"] for s in train} == {2, 4, 6} and all(len(s) == 5 for s in train)
    assert set(train[0]) == {"step", "prompt", "response", "ground_truth", "score"}
    val = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    assert {s["step"] for s in val} == {0, 3, 6} and set(val[0]) == {"step", "prompt", "response", "ground_truth", "score"}
    rollouts = sorted(int(p.stem) for p in (root / "rollouts").glob("*.jsonl"))
    assert rollouts == list(range(1, 7)), rollouts
    dumped = [json.loads(line) for line in (root / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(dumped) == 8 and set(dumped[0]) == {"input", "output", "gts", "score", "step"}
    assert sorted(int(p.stem) for p in (root / "validations").glob("*.jsonl")) == [0, 3, 6]
    logs = run_dir / "logs"
    assert {p.name for p in logs.iterdir()} >= {"driver.log", "trainer_rank0.log", "rollout_replica0.log"}
    replica_log = (logs / "rollout_replica0.log").read_text()
    assert "Initializing a V1 LLM engine" in replica_log  # vLLM's engine core writes there too (on CPU, in-process)
    assert "Failed to load weights" not in replica_log

    # 5. the same command once more: finished, before any engine starts
    began = time.monotonic()
    proc, lines = start(), []
    rc = finish(proc, lines, timeout_s=120)
    output = "\n".join(lines)
    print(f"finished run: {time.monotonic() - began:.1f} s\n{output}")
    assert rc == 0 and f"has finished already: its checkpoint {run_dir / 'actor' / 'step_6'} holds step 6 of 6" in output
    assert "Ray cluster:" not in output and "ready in" not in output
