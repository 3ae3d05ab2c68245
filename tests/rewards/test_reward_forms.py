"""Reward function forms (per sample, verl's batch, two lists, async) and verl's dapo manager."""
from __future__ import annotations

import textwrap

import pytest
from omegaconf import OmegaConf

from megarl.rewards import RewardFunction, RewardFunctionError, RewardManager
from megarl.rewards.manager_keys import OverlongPenalty
from megarl.settings.rewards import overlong_penalty, reward_manager

FORMS = textwrap.dedent('''
    import asyncio

    def compute_reward(responses, ground_truths):              # the seed guide's batch form
        return [1.0 if r.strip() == g else 0.0 for r, g in zip(responses, ground_truths)]

    def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        return [{"score": float(s == g) + bonus, "source": d} for d, s, g in zip(data_sources, solution_strs, ground_truths)]

    def wrong_length(responses, ground_truths):
        return [1.0]

    def raises(responses, ground_truths):
        raise RuntimeError("judge unavailable")

    async def async_batch(responses, ground_truths):
        await asyncio.sleep(0)
        return [float(len(r)) for r in responses]

    BARRIER = {}

    async def async_sample(data_source, solution_str, ground_truth, extra_info=None):
        # completes only if every sample of the batch is awaited at the same time
        barrier = BARRIER.setdefault(asyncio.get_running_loop(), asyncio.Barrier(extra_info["n"]))
        await asyncio.wait_for(barrier.wait(), timeout=10)
        return float(solution_str == ground_truth)
''')


@pytest.fixture()
def forms(tmp_path):
    path = tmp_path / "forms.py"
    path.write_text(FORMS)
    return str(path)


def test_forms_are_detected_from_the_signature(forms):
    assert RewardFunction(forms, "compute_reward").form == "lists"
    assert RewardFunction(forms, "verl_batch", {"bonus": 1.0}).form == "batch"
    fn = RewardFunction(forms, "async_sample")
    assert (fn.form, fn.is_async) == ("sample", True)


def test_seed_batch_form_scores_lists(forms):
    manager = RewardManager(RewardFunction(forms, "compute_reward"))
    result = manager.score(["unknown"] * 3, ["7", " 8", "9"], ["7", "8", "1"])
    assert result.scores == [1.0, 1.0, 0.0] and result.errors == []


def test_verl_batch_form_gets_keywords_and_reward_kwargs(forms):
    result = RewardManager(RewardFunction(forms, "verl_batch", {"bonus": 0.5})).score(["a", "b"], ["x", "y"], ["x", "z"])
    assert result.scores == [1.5, 0.5] and result.extra["source"] == ["a", "b"]


def test_batch_form_bad_returns_and_errors(forms):
    with pytest.raises(RewardFunctionError, match="1 values for a batch of 2 responses"):
        RewardManager(RewardFunction(forms, "wrong_length")).score(["a", "b"], ["x", "y"], ["x", "y"])
    result = RewardManager(RewardFunction(forms, "raises")).score(["a", "b"], ["x", "y"], ["x", "y"])
    assert result.scores == [0.0, 0.0] and result.metrics["reward/num_errors"] == 2
    assert "RuntimeError: judge unavailable" in result.metrics["reward/first_error"]
    with pytest.raises(RewardFunctionError, match="judge unavailable"):
        RewardManager(RewardFunction(forms, "raises"), on_error="raise").score(["a"], ["x"], ["x"])


def test_async_functions_are_awaited_concurrently(forms):
    assert RewardManager(RewardFunction(forms, "async_batch")).score(["a", "b"], ["xy", "z"], ["", ""]).scores == [2.0, 1.0]
    n = 4
    result = RewardManager(RewardFunction(forms, "async_sample"), on_error="raise").score(
        ["a"] * n, ["1", "2", "3", "4"], ["1", "0", "3", "0"], [{"n": n}] * n)
    assert result.scores == [1.0, 0.0, 1.0, 0.0]


def test_batch_forms_refuse_the_per_sample_manager_settings(forms):
    with pytest.raises(ValueError, match="set reward.num_workers=1"):
        RewardManager(RewardFunction(forms, "compute_reward"), num_workers=2)
    with pytest.raises(ValueError, match="reward_manager=batch calls the reward function once per batch"):
        RewardManager(lambda **kw: 1.0, kind="batch")


def test_dapo_overlong_penalty_values_and_logged_extras():
    """verl's DAPO manager: expected = max_resp_len - len; penalty = min(-(L - expected) / len * factor, 0)."""
    penalty = OverlongPenalty(buffer_len=4, penalty_factor=2.0, max_resp_len=10, log=True)
    assert [penalty(length) for length in (3, 6, 7, 8, 10)] == [0.0, 0.0, -0.5, -1.0, -2.0]
    manager = RewardManager(lambda **kw: 1.0, kind="dapo", overlong=penalty)
    result = manager.score(["d"] * 3, ["a", "b", "c"], ["g"] * 3, response_lengths=[5, 8, 10])
    assert result.scores == [1.0, 0.0, -1.0]
    assert result.extra["acc"] == [1.0, 1.0, 1.0]  # verl's dapo manager records a plain score as acc
    assert result.extra["overlong_reward"] == [0.0, -1.0, -2.0] and result.extra["overlong"] == [False, True, True]
    with pytest.raises(ValueError, match="needs the response length"):
        manager.score(["d"], ["a"], ["g"])


def test_overlong_penalty_from_either_place_of_the_config():
    newer = OmegaConf.create({"data": {"max_response_length": 512}, "reward_model": {
        "reward_manager": "dapo", "overlong_buffer": {"enable": False},
        "reward_kwargs": {"max_resp_len": 256, "overlong_buffer_cfg": {"enable": True, "len": 64, "penalty_factor": 0.5}}}})
    assert overlong_penalty(newer) == OverlongPenalty(64, 0.5, 256, False)
    older = OmegaConf.create({"data": {"max_response_length": 512}, "reward_model": {
        "reward_manager": "dapo", "reward_kwargs": {},
        "overlong_buffer": {"enable": True, "len": 32, "penalty_factor": 1.0, "log": True}}})
    assert overlong_penalty(older) == OverlongPenalty(32, 1.0, 512, True)  # max_resp_len: data.max_response_length
    manager = reward_manager(older)
    assert manager.kind == "dapo" and manager.overlong == OverlongPenalty(32, 1.0, 512, True)


def test_batch_manager_passes_its_reward_kwargs_to_the_function(forms):
    cfg = OmegaConf.create({"custom_reward_function": {"path": forms, "name": "verl_batch"},
                            "reward_model": {"reward_manager": "batch", "reward_kwargs": {"bonus": 2.0}}})
    manager = reward_manager(cfg)  # verl's batch manager forwards reward_model.reward_kwargs
    assert manager.score(["a"], ["x"], ["x"]).scores == [3.0]
