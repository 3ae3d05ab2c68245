"""Custom reward functions by path, the reward manager (errors, parallelism), token-level scores."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from megarl.rewards import (
    RewardFunction,
    RewardFunctionError,
    RewardFunctionLoadError,
    RewardManager,
    default_compute_score,
    scores_to_token_level,
)
from megarl.settings.rewards import load_reward_function, reward_manager

os.environ.setdefault("OMP_NUM_THREADS", "1")

REWARD_FILE = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        """1.0 if the response contains the ground truth."""
        return 1.0 if str(ground_truth) in solution_str else 0.0

    def with_details(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        hit = str(ground_truth) in solution_str
        return {"score": float(hit) + bonus, "acc": hit, "length": len(solution_str), "note": "text is allowed"}

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            raise ValueError("cannot grade " + solution_str)
        return 1.0

    def rules_or_boom(data_source, solution_str, ground_truth, extra_info=None):
        from megarl.rewards import default_compute_score

        if "boom" in solution_str:
            raise RuntimeError("boom")
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)

    def returns_string(data_source, solution_str, ground_truth, extra_info=None):
        return "1.0"

    def too_few_args(solution_str):
        return 0.0

    NOT_A_FUNCTION = 3
''')


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def test_custom_function_float_return(reward_file):
    manager = RewardManager(RewardFunction(reward_file))  # default name: compute_score
    result = manager.score(["any", "any"], ["it is 7", "it is 8"], ["7", "7"])
    assert result.scores == [1.0, 0.0]
    assert result.metrics["reward/num_errors"] == 0 and result.metrics["reward/score/mean"] == 0.5


def test_custom_function_dict_return_and_reward_kwargs(reward_file):
    cfg = OmegaConf.create({"path": reward_file, "name": "with_details", "reward_kwargs": {"bonus": 0.5}})
    manager = RewardManager(load_reward_function(cfg))
    result = manager.score_samples([
        {"data_source": "d", "response": "7!", "ground_truth": "7"},
        {"data_source": "d", "solution_str": "no", "ground_truth": "7", "extra_info": {"k": 1}},
    ])
    assert result.scores == [1.5, 0.5]
    assert result.extra == {"acc": [True, False], "length": [2, 2], "note": ["text is allowed"] * 2}
    assert result.metrics["reward/acc/mean"] == 0.5 and result.metrics["reward/length/mean"] == 2.0
    assert "reward/note/mean" not in result.metrics


def test_custom_function_load_errors(reward_file, tmp_path):
    with pytest.raises(RewardFunctionLoadError, match=r"function 'missing' not found in .*my_reward\.py.*compute_score"):
        RewardFunction(reward_file, "missing")
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        RewardFunction(str(tmp_path / "nowhere.py"))
    with pytest.raises(RewardFunctionLoadError, match=r"fits none of the reward forms: compute_score\(data_source, solution_str, ground_truth"):
        RewardFunction(reward_file, "too_few_args")
    with pytest.raises(RewardFunctionLoadError, match="is a int, not a function"):
        RewardFunction(reward_file, "NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(RewardFunctionLoadError, match="importing custom reward file .*broken.py.* failed: ModuleNotFoundError"):
        RewardFunction(str(broken))


def test_wrong_return_type_is_a_clear_error(reward_file):
    manager = RewardManager(RewardFunction(reward_file, "returns_string"), on_error="zero")
    with pytest.raises(RewardFunctionError, match="returned str '1.0' for sample 0.*finite number or a dict"):
        manager.score(["d"], ["x"], ["y"])


def test_no_path_means_builtin_rules_with_kwargs():
    assert load_reward_function(None) is default_compute_score
    flexible = load_reward_function({"path": None, "reward_kwargs": {"method": "flexible"}})
    assert flexible("openai/gsm8k", "the answer is 4", "4") == 1.0
    assert default_compute_score("openai/gsm8k", "the answer is 4", "4") == 0.0


def test_raising_function_scores_zero_and_is_counted(reward_file, caplog):
    manager = RewardManager(RewardFunction(reward_file, "flaky"))
    result = manager.score(["d"] * 4, ["ok", "boom 1", "ok", "boom 2"], ["1"] * 4)
    assert result.scores == [1.0, 0.0, 1.0, 0.0]
    assert result.metrics["reward/num_errors"] == 2
    assert result.metrics["reward/first_error"] == "sample 1 (d): ValueError: cannot grade boom 1"
    assert [e.index for e in result.errors] == [1, 3]
    assert "raised on 2 of 4 samples" in caplog.text and "cannot grade boom 1" in caplog.text


def test_on_error_raise_names_the_sample(reward_file):
    manager = RewardManager(RewardFunction(reward_file, "flaky"), on_error="raise")
    with pytest.raises(RewardFunctionError, match=r"raised on sample 2 \(data_source='d'\): ValueError: cannot grade boom"):
        manager.score(["d"] * 3, ["ok", "ok", "boom"], ["1"] * 3)


def _batch(data_sources=("openai/gsm8k", "megarl/arithmetic", "lighteval/MATH")):
    responses, truths, sources = [], [], []
    for i in range(40):
        sources.append(data_sources[i % len(data_sources)])
        truths.append(str(i % 7))
        responses.append({"openai/gsm8k": f"#### {i % 5}", "megarl/arithmetic": f"{i % 7} is it",
                          "lighteval/MATH": f"\\boxed{{{i % 4}}}"}[sources[-1]])
    return sources, responses, truths


@pytest.mark.heavy  # worker processes
@pytest.mark.timeout(120)
def test_parallel_processes_equal_sequential(reward_file):
    # gsm8k and arithmetic only: MATH would make each worker import math-verify (slow on 2 cores);
    # the thread test below covers MATH
    sources, responses, truths = _batch(("openai/gsm8k", "megarl/arithmetic"))
    responses = [r + (" boom" if i % 6 == 0 else "") for i, r in enumerate(responses)]
    # independent reference: a plain loop over the built-in rules, 0 where the file's function raises
    reference = [0.0 if "boom" in r else default_compute_score(s, r, t) for s, r, t in zip(sources, responses, truths)]
    assert 0 < sum(reference) < len(reference)

    # a function loaded from a file (it calls the built-in rules and raises on "boom"), in worker processes
    sequential = RewardManager(RewardFunction(reward_file, "rules_or_boom")).score(sources, responses, truths)
    with RewardManager(RewardFunction(reward_file, "rules_or_boom"), num_workers=2, executor="process") as parallel:
        result = parallel.score(sources, responses, truths)
    assert result.scores == sequential.scores == reference
    assert result.metrics == sequential.metrics
    assert result.metrics["reward/num_errors"] == 7  # i = 0, 6, ..., 36


def test_parallel_threads_equal_sequential():
    sources, responses, truths = _batch()
    sequential = RewardManager().score(sources, responses, truths)
    with RewardManager(num_workers=3, executor="thread") as threaded:
        assert threaded.score(sources, responses, truths).scores == sequential.scores


def test_unpicklable_function_with_processes_is_refused():
    with pytest.raises(ValueError, match="reward.executor=thread"):
        RewardManager(lambda **kw: 1.0, num_workers=2, executor="process")


def test_from_config(reward_file):
    cfg = OmegaConf.create({"custom_reward_function": {"path": reward_file, "name": "compute_score"},
                            "reward": {"num_workers": 1, "on_error": "raise"}})
    manager = reward_manager(cfg)
    assert manager.on_error == "raise"
    assert manager.score(["d"], ["42"], ["42"]).scores == [1.0]


def test_scores_to_token_level():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    token_scores = scores_to_token_level([0.5, 1.0, -1.0, 2.0], mask)
    expected = torch.zeros(4, 5)
    expected[0, 2], expected[1, 4], expected[2, 0], expected[3, 0] = 0.5, 1.0, -1.0, 2.0
    assert torch.equal(token_scores, expected)
    assert torch.equal(token_scores.sum(-1), torch.tensor([0.5, 1.0, -1.0, 2.0]))
    with pytest.raises(ValueError, match="3 scores for a response_mask with 4 rows"):
        scores_to_token_level([1.0, 2.0, 3.0], mask)
