"""DAPO: dynamic-sampling group filter, generation budget, overlong reward shaping."""

import numpy as np
import pytest
import torch

from megarl.algorithms import compute_overlong_penalty, filter_groups_by_metric, need_more_gen_batches, seq_metric_values


def test_filter_groups_hand_computed():
    index = np.array(["a", "a", "b", "b", "c", "d", "d", "d"], dtype=object)
    acc = [1, 0, 1, 1, 0.5, 0, 0, 1]
    kept, metrics = filter_groups_by_metric(index, acc)
    # b (all 1) is dropped; c (a single sample) is kept, as in verl
    assert kept.tolist() == [0, 1, 4, 5, 6, 7] and kept.dtype == np.int64
    assert metrics == {
        "filter_groups/num_groups_kept": 3,
        "filter_groups/num_groups_dropped": 1,
        "filter_groups/num_samples_kept": 6,
    }


def test_filter_groups_matches_loop():
    rng = np.random.default_rng(0)
    index = rng.integers(0, 12, size=60)
    values = rng.integers(0, 2, size=60).astype(float)
    kept, metrics = filter_groups_by_metric(index, torch.tensor(values))
    expected = []
    for i, key in enumerate(index):
        group = [values[j] for j in range(60) if index[j] == key]
        if len(group) == 1 or any(v != group[0] for v in group):
            expected.append(i)
    assert kept.tolist() == expected
    assert metrics["filter_groups/num_samples_kept"] == len(expected)


def test_filter_groups_drops_equal_floats_that_np_std_calls_different():
    # np.std([0.1] * 3) is 1.4e-17, not 0; equal values are compared exactly instead.
    kept, metrics = filter_groups_by_metric(["p"] * 3 + ["q"] * 2, [0.1, 0.1, 0.1, 0.2, 0.3])
    assert kept.tolist() == [3, 4] and metrics["filter_groups/num_groups_dropped"] == 1


def test_filter_groups_bad_input():
    with pytest.raises(ValueError, match="one metric value per sample"):
        filter_groups_by_metric(["a", "a"], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        filter_groups_by_metric(["a", "a"], [1.0, float("nan")])


def test_need_more_gen_batches():
    assert need_more_gen_batches(num_prompts_in_batch=8, train_batch_size=8, num_gen_batches=1, max_num_gen_batches=1) is False
    assert need_more_gen_batches(5, 8, num_gen_batches=1, max_num_gen_batches=3) is True
    assert need_more_gen_batches(5, 8, num_gen_batches=50, max_num_gen_batches=0) is True  # 0: no limit
    with pytest.raises(RuntimeError, match="max_num_gen_batches=3"):
        need_more_gen_batches(5, 8, num_gen_batches=3, max_num_gen_batches=3)


def test_seq_metric_values():
    scores = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    rewards = scores - 0.25
    assert seq_metric_values("seq_reward", token_level_scores=scores).tolist() == [1.0, 0.5]
    assert seq_metric_values("seq_final_reward", token_level_rewards=rewards).tolist() == [0.5, 0.0]
    assert seq_metric_values("acc", reward_extra_info={"acc": [True, False]}).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="Known names: seq_reward, seq_final_reward, score"):
        seq_metric_values("acc", reward_extra_info={"score": [1.0]})


def test_overlong_penalty_hand_computed():
    penalty = compute_overlong_penalty([50, 80, 90, 95, 100], max_response_length=100, overlong_buffer_len=20, penalty_factor=1.0)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.5, -0.75, -1.0])
    penalty = compute_overlong_penalty(torch.tensor([0, 100]), 100, 20, penalty_factor=0.5)
    assert penalty.tolist() == pytest.approx([0.0, -0.5])


def test_overlong_penalty_matches_verl_loop():
    lengths = list(range(0, 513, 7))
    penalty = compute_overlong_penalty(lengths, 512, 128, 2.0)
    for length, value in zip(lengths, penalty.tolist()):
        expected_len = 512 - 128
        assert value == pytest.approx(min(-(length - expected_len) / 128 * 2.0, 0), abs=1e-6)


def test_overlong_penalty_bad_config():
    with pytest.raises(ValueError, match="must be > 0"):
        compute_overlong_penalty([1], 100, 0, 1.0)
    with pytest.raises(ValueError, match="exceeds the max response length"):
        compute_overlong_penalty([1], 100, 200, 1.0)
