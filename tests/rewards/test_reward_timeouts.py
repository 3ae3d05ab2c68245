"""A reward function that never returns for some inputs: those samples score 0 as timeouts, the pass goes on.

Every path is checked with a function that hangs forever on responses containing "hang": a busy
loop in pure Python (no thread can interrupt it; the worker process running it is killed), a sleep
in a thread (left behind), an ``async def`` that never wakes up (cancelled) and a batch-form call.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from megarl.settings.rewards import reward_manager
from megarl.checks import ConfigError, load_config
from megarl.rewards import RewardFunction, RewardFunctionError, RewardManager
from megarl.rewards.pool import RewardPool

pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]  # reward worker processes
REPO = Path(__file__).resolve().parents[2]

HANGING = textwrap.dedent('''
    import asyncio, time

    def busy(data_source, solution_str, ground_truth, extra_info=None):
        while "hang" in solution_str:  # pure Python: no thread or signal of another thread stops it
            pass
        return float(solution_str.strip() == ground_truth)

    def sleeps(data_source, solution_str, ground_truth, extra_info=None):
        if "hang" in solution_str:
            time.sleep(3600)
        return float(solution_str.strip() == ground_truth)

    async def waits(data_source, solution_str, ground_truth, extra_info=None):
        if "hang" in solution_str:
            await asyncio.Event().wait()
        return float(solution_str.strip() == ground_truth)

    def batch(data_sources, solution_strs, ground_truths, extra_infos):
        while any("hang" in s for s in solution_strs):
            pass
        return [float(s.strip() == g) for s, g in zip(solution_strs, ground_truths)]

    def crashes(data_source, solution_str, ground_truth, extra_info=None):
        if "crash" in solution_str:
            import os
            os._exit(3)  # as a segfault in a C extension would
        return 1.0
''')
RESPONSES = ["1", "hang 2", "3", "4", "hang 5", "6", "7", "8"]
TRUTHS = ["1", "2", "3", "0", "5", "6", "7", "8"]
EXPECTED = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # the hung samples score 0, like a function that raises


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "hanging_reward.py"
    path.write_text(HANGING)
    return str(path)


def score(manager: RewardManager, responses=RESPONSES, truths=TRUTHS):
    with manager:
        return manager.score(["d"] * len(responses), responses, truths)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_call_stuck_in_pure_python_is_stopped_by_killing_its_worker(reward_file, workers, caplog):
    manager = RewardManager(RewardFunction(reward_file, "busy"), num_workers=workers, timeout_s=1.0)
    children_before = {p.pid for p in psutil.Process().children()}
    with manager:
        result = manager.score(["d"] * 8, RESPONSES, TRUTHS)
        assert manager._pool.replaced == 2  # each stuck worker was killed and replaced
    assert result.scores == EXPECTED
    assert result.metrics["reward/num_timeouts"] == 2 and result.metrics["reward/num_errors"] == 2
    assert [(e.index, e.timed_out) for e in result.errors] == [(1, True), (4, True)]
    assert result.metrics["reward/first_error"] == ("sample 1 (d): the reward function ran longer than "
                                                    "reward.compute_score_timeout=1 s (its worker process was killed)")
    assert "ran longer than reward.compute_score_timeout=1 s on 2 of 8 samples and they scored 0" in caplog.text
    left = [p for p in psutil.Process().children() if p.pid not in children_before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
    assert not left, f"reward workers outlived close(): {[p.cmdline() for p in left]}"


def test_a_worker_that_dies_costs_its_sample_an_error_and_is_replaced(reward_file):
    result = score(RewardManager(RewardFunction(reward_file, "crashes"), timeout_s=30.0),
                   ["a", "crash", "b"], ["x", "y", "z"])
    assert result.scores == [1.0, 0.0, 1.0] and result.metrics["reward/num_timeouts"] == 0
    assert "the reward worker process died (exit code 3)" in result.errors[0].error


def test_workers_that_cannot_start_are_an_error_not_a_hang(tmp_path):
    """Workers are spawned: an entry script without a __main__ guard makes every one fail at start."""
    script = tmp_path / "no_guard.py"
    script.write_text("from megarl.rewards import RewardManager\n"
                      "print(RewardManager(timeout_s=5).score(['openai/gsm8k'], ['#### 1'], ['1']).scores)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and "RewardWorkerError: a reward worker process could not start" in done.stderr
    assert "needs an `if __name__ == '__main__':` guard" in done.stderr


def test_threads_score_a_timeout_and_leave_the_stuck_call_behind(reward_file):
    result = score(RewardManager(RewardFunction(reward_file, "sleeps"), num_workers=2, executor="thread", timeout_s=1.0))
    assert result.scores == EXPECTED and result.metrics["reward/num_timeouts"] == 2
    assert "its thread is left running" in result.errors[0].error


def test_async_calls_are_cancelled_at_the_limit(reward_file):
    result = score(RewardManager(RewardFunction(reward_file, "waits"), timeout_s=1.0))
    assert result.scores == EXPECTED and result.metrics["reward/num_timeouts"] == 2
    assert result.errors[0].error.endswith("(cancelled)")


def test_a_batch_form_call_past_the_limit_fails_the_batch(reward_file, caplog):
    manager = RewardManager(RewardFunction(reward_file, "batch"), timeout_s=1.0)
    result = score(manager)
    assert result.scores == [0.0] * 8 and result.metrics["reward/num_timeouts"] == 8
    assert "a batch-form function's call scores the whole batch" in caplog.text
    with RewardManager(RewardFunction(reward_file, "batch"), timeout_s=1.0) as again:  # without a hang: scored
        assert again.score(["d"] * 3, ["1", "2", "x"], ["1", "2", "3"]).scores == [1.0, 1.0, 0.0]


def test_on_error_raise_stops_at_a_timeout(reward_file):
    with pytest.raises(RewardFunctionError, match=r"timed out on sample 1 \(data_source='d'\): the reward function "
                                                  r"ran longer than reward.compute_score_timeout=1 s"):
        score(RewardManager(RewardFunction(reward_file, "busy"), timeout_s=1.0, on_error="raise"))


def test_the_pass_reports_progress_per_finished_response(reward_file, monkeypatch):
    import megarl.rewards.manager as manager_module

    seen = []

    class Recorder:
        def __init__(self, what, total=None, unit="items", **kw):
            seen.append((what, total, unit))
            self.done = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen.append(("done", self.done))

        def update(self, amount=1):
            self.done += amount

        def set(self, done):
            assert self.done == done, "every response is reported as it finishes"

    monkeypatch.setattr(manager_module, "Progress", Recorder)
    score(RewardManager(RewardFunction(reward_file, "busy"), num_workers=2, timeout_s=1.0))
    assert seen == [("rewards", 8, "responses"), ("done", 8)]


def test_pool_without_a_limit_scores_like_the_caller(reward_file):
    function = RewardFunction(reward_file, "busy")
    pool = RewardPool(function, 2, None)
    try:
        samples = [("d", r, t, None, {}) for r, t in zip(["1", "2", "x"], ["1", "0", "x"])]
        assert [o[1] for o in pool.run("sample", samples)] == [1.0, 0.0, 1.0]
    finally:
        pool.close()


BASE = ["data.train_files=x.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]


def test_the_limit_comes_from_the_config_or_verls_spelling():
    assert reward_manager(load_config(None, BASE)).timeout_s == 30.0  # the default
    assert reward_manager(load_config(None, BASE + ["reward.compute_score_timeout=null"])).timeout_s is None
    verl = load_config(None, BASE + ["reward_model.reward_kwargs.compute_score_timeout=5"])  # verl's naive manager's
    assert reward_manager(verl).timeout_s == 5.0
    assert reward_manager(load_config(None, BASE + ["reward.reward_kwargs.compute_score_timeout=5",
                                                               "reward.compute_score_timeout=5"])).timeout_s == 5.0
    with pytest.raises(ConfigError, match="reward.compute_score_timeout=10.0 and reward_model.reward_kwargs."
                                          "compute_score_timeout=5 .* differ"):
        load_config(None, BASE + ["reward.compute_score_timeout=10", "reward_model.reward_kwargs.compute_score_timeout=5"])
    with pytest.raises(ConfigError, match=r"reward.compute_score_timeout=-1.0: give the seconds"):
        load_config(None, BASE + ["reward.compute_score_timeout=-1"])
    # the batch manager passes reward_kwargs to the function: the limit is the manager's, not the function's
    from megarl.settings.rewards import function_kwargs

    cfg = OmegaConf.create({"reward_model": {"reward_manager": "batch",
                                             "reward_kwargs": {"compute_score_timeout": 5, "scale": 2}}})
    assert function_kwargs(cfg) == {"scale": 2}
