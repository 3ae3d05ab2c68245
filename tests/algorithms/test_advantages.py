"""Advantage estimators: hand-computed examples, plain-loop references, edge cases, properties."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import _algo_reference as ref
import megarl.algorithms as algos
from megarl.algorithms import get_adv_estimator


def outcome_batch(scores, lengths, width):
    """Outcome rewards on the last valid token of each response, right-padded to `width`."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1
        if length:
            rewards[i, length - 1] = score
    return rewards, mask


def random_batch(seed, batch=10, width=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen).tolist()
    lengths[3] = 0  # one empty response
    scores = torch.randint(0, 3, (batch,), generator=gen).float().tolist()
    rewards, mask = outcome_batch(scores, lengths, width)
    index = ["p0", "p0", "p0", "p1", "p1", "p2", "p3", "p3", "p3", "p3"][:batch]  # p2 is a group of one
    return rewards, mask, np.array(index, dtype=object)


def flat(t):
    return sum(ref.rows(t), [])


def close(actual, expected, tol=1e-5):
    return flat(actual) == pytest.approx(sum(expected, []), rel=tol, abs=tol)


# ----------------------------------------------------------------------- hand-computed
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
LENGTHS = [3, 2, 4, 1, 4, 2]
INDEX = np.array(["a", "a", "a", "b", "b", "c"])


def per_sample(adv, mask):
    """The scalar advantage of each sample (the value on its first valid token, 0 if empty)."""
    return [row[0] if m[0] else 0.0 for row, m in zip(ref.rows(adv), ref.rows(mask))]


def test_grpo_hand_computed():
    rewards, mask = outcome_batch(SCORES, LENGTHS, 4)
    adv, ret = algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=INDEX)
    std_a = math.sqrt(1 / 3)  # unbiased std of 1, 0, 0
    expected = [(2 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), 0.0, 0.0, 0.5 / (1 + 1e-6)]
    assert per_sample(adv, mask) == pytest.approx(expected, rel=1e-5)
    assert torch.equal(adv, ret)
    assert (adv[mask == 0] == 0).all()


def test_dr_grpo_hand_computed():
    rewards, mask = outcome_batch(SCORES, LENGTHS, 4)
    adv, _ = algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=INDEX, norm_adv_by_std_in_grpo=False
    )
    assert per_sample(adv, mask) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.5], rel=1e-6)


def test_rloo_hand_computed():
    rewards, mask = outcome_batch(SCORES, LENGTHS, 4)
    adv, _ = algos.compute_rloo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=INDEX)
    # a: 1 - mean(0, 0), 0 - mean(1, 0), ...; b: 1 - 1; c alone keeps its reward
    assert per_sample(adv, mask) == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 0.5], rel=1e-6)


def test_grpo_passk_hand_computed():
    rewards, mask = outcome_batch(SCORES[:5], LENGTHS[:5], 4)
    adv, _ = algos.compute_grpo_passk_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=INDEX[:5])
    assert per_sample(adv, mask) == pytest.approx([1 / (math.sqrt(1 / 3) + 1e-6), 0, 0, 0, 0], rel=1e-5)
    with pytest.raises(ValueError, match="at least 2 samples"):
        algos.compute_grpo_passk_outcome_advantage(token_level_rewards=rewards[:1], response_mask=mask[:1], index=["x"])


def test_gpg_hand_computed():
    """verl's gpg estimator: alpha * (R - mean_group), alpha = batch / non-zero rewards, no std division."""
    rewards, mask = outcome_batch(SCORES, LENGTHS, 4)
    adv, ret = get_adv_estimator("gpg")(token_level_rewards=rewards, response_mask=mask, index=INDEX)
    alpha = 6 / 4  # four of the six scores are non-zero
    a_mean, b_mean = 1 / 3, 1.0
    expected = [alpha * (1 - a_mean), alpha * (0 - a_mean), alpha * (0 - a_mean), alpha * (1 - b_mean),
                alpha * (1 - b_mean), alpha * 0.5]  # "c" is a group of one: its mean is 0
    assert per_sample(adv, mask) == pytest.approx(expected, rel=1e-6)
    assert torch.equal(adv, ret) and (adv[mask == 0] == 0).all()


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = algos.compute_gae_advantage_return(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    # A2 = 1 - 0.5 = 0.5; A1 = (0.9*0.5 - 0.5) + 0.72*0.5 = 0.31; A0 = -0.05 + 0.72*0.31 = 0.1732
    raw = [0.1732, 0.31, 0.5]
    assert ret[0, :3].tolist() == pytest.approx([a + 0.5 for a in raw], rel=1e-5)
    mean, std = sum(raw) / 3, math.sqrt(sum((a - sum(raw) / 3) ** 2 for a in raw) / 2)
    assert adv[0, :3].tolist() == pytest.approx([(a - mean) / std for a in raw], rel=1e-4)


def test_reinforce_plus_plus_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = algos.compute_reinforce_plus_plus_outcome_advantage(token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    assert ret.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]
    valid = [0.25, 0.5, 1.0, 1.0, 2.0]
    mean = sum(valid) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / 4)
    assert adv[mask.bool()].tolist() == pytest.approx([(v - mean) / std for v in valid], rel=1e-5)
    assert adv[1, 2].item() == 0.0


def test_remax_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = algos.compute_remax_outcome_advantage(
        token_level_rewards=rewards, reward_baselines=torch.tensor([0.4, 1.0]), response_mask=mask
    )
    assert flat(ret) == pytest.approx([1.0, 1.0, 1.0, 0.3, 0.3, 0.0])
    assert flat(adv) == pytest.approx([0.6, 0.6, 0.6, -0.7, -0.7, 0.0])
    with pytest.raises(ValueError, match="reward_baselines"):
        algos.compute_remax_outcome_advantage(token_level_rewards=rewards, reward_baselines=None, response_mask=mask)


def test_opo_hand_computed():
    rewards, mask = outcome_batch([1.0, 0.0], [2, 4], 4)
    adv, _ = algos.compute_opo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=[7, 7])
    # length-weighted baseline: (2*1 + 4*0) / 6 = 1/3
    assert per_sample(adv, mask) == pytest.approx([2 / 3, -1 / 3], rel=1e-6)


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards, mask = outcome_batch([1.0, 0.0], [1, 2], 2)
    adv, _ = algos.compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=[0, 0])
    # centred scores 0.5 (1 token) and -0.5 (2 tokens), whitened over the 3 valid tokens
    valid = [0.5, -0.5, -0.5]
    mean = sum(valid) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / 2)
    assert adv[mask.bool()].tolist() == pytest.approx([(v - mean) / std for v in valid], rel=1e-5)
    assert adv[0, 1].item() == 0.0


# --------------------------------------------------------------------- loop references
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_estimators_match_loop_references(seed):
    rewards, mask, index = random_batch(seed)
    r, m, idx = ref.rows(rewards), ref.rows(mask), list(index)
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    for norm in (True, False):
        adv, _ = algos.compute_grpo_outcome_advantage(**kwargs, norm_adv_by_std_in_grpo=norm)
        assert close(adv, ref.grpo(r, m, idx, norm=norm))
    assert close(algos.compute_rloo_outcome_advantage(**kwargs)[0], ref.rloo(r, m, idx))
    assert close(algos.compute_opo_outcome_advantage(**kwargs)[0], ref.opo(r, m, idx))
    assert close(algos.compute_reinforce_plus_plus_baseline_outcome_advantage(**kwargs)[0],
                 ref.reinforce_plus_plus_baseline(r, m, idx), tol=1e-4)
    keep = [i for i, key in enumerate(idx) if key != "p2"]  # pass@k needs groups of >= 2
    adv, _ = algos.compute_grpo_passk_outcome_advantage(
        token_level_rewards=rewards[keep], response_mask=mask[keep], index=index[keep]
    )
    assert close(adv, ref.grpo_passk([r[i] for i in keep], [m[i] for i in keep], [idx[i] for i in keep]))


@pytest.mark.parametrize("seed", [0, 1])
def test_token_level_estimators_match_loop_references(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(5, 7, generator=gen)
    values = torch.randn(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) > 0.25).float()  # holes in the middle too
    mask[4] = 0
    r, v, m = ref.rows(rewards), ref.rows(values), ref.rows(mask)

    adv, ret = algos.compute_gae_advantage_return(token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.95, lam=0.9)
    ref_adv, ref_ret = ref.gae(r, v, m, 0.95, 0.9)
    assert close(ret, ref_ret) and close(adv, ref_adv, tol=1e-4)

    adv, ret = algos.compute_reinforce_plus_plus_outcome_advantage(token_level_rewards=rewards, response_mask=mask, gamma=0.9)
    ref_adv, ref_ret = ref.reinforce_plus_plus(r, m, 0.9)
    assert close(ret, ref_ret) and close(adv, ref_adv, tol=1e-4)

    baselines = torch.randn(5, generator=gen)
    adv, ret = algos.compute_remax_outcome_advantage(token_level_rewards=rewards, reward_baselines=baselines, response_mask=mask)
    ref_adv, ref_ret = ref.remax(r, m, baselines.tolist())
    assert close(ret, ref_ret) and close(adv, ref_adv)


# -------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("name", sorted(algos.ADVANTAGE_ESTIMATORS))
def test_all_empty_responses_give_zeros_not_nan(name):
    rewards = torch.zeros(4, 3)
    mask = torch.zeros(4, 3)
    adv, ret, *_ = get_adv_estimator(name)(
        token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b", "b"], values=torch.zeros(4, 3),
        reward_baselines=torch.zeros(4), gamma=1.0, lam=1.0, epsilon=1e-6, norm_adv_by_std_in_grpo=True,
        old_log_prob=torch.zeros(4, 3), ref_log_prob=torch.zeros(4, 3),
    )
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv == 0).all()


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline", "opo"])
def test_all_equal_rewards_give_zero_advantages(name):
    rewards, mask = outcome_batch([1.0] * 6, [3, 1, 2, 3, 3, 2], 3)
    adv, _ = get_adv_estimator(name)(token_level_rewards=rewards, response_mask=mask, index=[0, 0, 0, 1, 1, 1])
    assert torch.isfinite(adv).all() and (adv.abs() < 1e-6).all()


def test_group_of_one_uses_mean_zero_and_std_one():
    rewards, mask = outcome_batch([0.7], [2], 2)
    for name, expected in (("grpo", 0.7 / (1 + 1e-6)), ("rloo", 0.7), ("opo", 0.7)):
        adv, _ = get_adv_estimator(name)(token_level_rewards=rewards, response_mask=mask, index=["solo"])
        assert flat(adv) == pytest.approx([expected, expected], rel=1e-6)


@pytest.mark.parametrize(
    "index",
    [
        ["a", "a", "a", "b", "b", "c"],
        np.array(["a", "a", "a", "b", "b", "c"]),
        np.array([5, 5, 5, 9, 9, 1]),
        [5, 5, 5, np.int64(9), 9, 1],  # numpy and Python ints are the same id
        torch.tensor([5, 5, 5, 9, 9, 1]),
    ],
)
def test_index_kinds_give_the_same_groups(index):
    rewards, mask = outcome_batch(SCORES, LENGTHS, 4)
    adv, _ = algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=index)
    expected, _ = algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=INDEX)
    assert torch.equal(adv, expected)


def test_bad_inputs_are_reported():
    rewards, mask = outcome_batch(SCORES, LENGTHS, 4)
    with pytest.raises(ValueError, match="index has 2 entries but the batch has 6"):
        algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=["a", "b"])
    with pytest.raises(ValueError, match="pass `index`"):
        algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=None)
    with pytest.raises(ValueError, match=r"\[batch, response_len\]"):
        algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask[:, :2], index=INDEX)


def test_estimators_do_not_track_gradients_or_touch_inputs():
    rewards, mask = outcome_batch(SCORES, LENGTHS, 4)
    rewards.requires_grad_(True)
    before = rewards.detach().clone()
    adv, _ = algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=INDEX)
    assert not adv.requires_grad and torch.equal(rewards.detach(), before)


def test_no_device_assumptions_in_the_source():
    for path in Path(algos.__file__).parent.glob("*.py"):
        assert "cuda" not in path.read_text(), f"{path.name} mentions cuda"


# -------------------------------------------------------------------------- properties
group_sizes = st.lists(st.integers(2, 5), min_size=1, max_size=4)


@settings(max_examples=50, deadline=None)
@given(group_sizes, st.data(), st.booleans())
def test_grpo_and_rloo_advantages_sum_to_zero_per_group(sizes, data, norm):
    n = sum(sizes)
    scores = data.draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=n, max_size=n))
    index = [g for g, size in enumerate(sizes) for _ in range(size)]
    rewards, mask = outcome_batch(scores, [2] * n, 2)
    grpo, _ = algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm
    )
    rloo, _ = algos.compute_rloo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=index)
    for adv in (grpo, rloo):
        for g in range(len(sizes)):
            members = [i for i, key in enumerate(index) if key == g]
            assert abs(adv[members, 0].double().sum().item()) < 1e-3


@pytest.mark.parametrize("value", [5.6102133420806375, 0.1, -7.3, 1.0 / 3.0])
@pytest.mark.parametrize("size", [3, 5, 16])
def test_a_group_of_identical_rewards_gets_exactly_zero_advantage(value, size):
    # float32 group means could miss identical scores by one ulp; divided by a std of that order,
    # [5.6102133420806375] * 3 once gave advantages of 0.301 (found by hypothesis in CI)
    rewards, mask = outcome_batch([value] * size, [2] * size, 2)
    adv, _ = algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask,
                                                  index=[0] * size)
    assert torch.count_nonzero(adv) == 0


@settings(max_examples=30, deadline=None)
@given(group_sizes, st.data())
def test_grpo_advantages_have_unit_sample_std_per_group(sizes, data):
    n = sum(sizes)
    scores = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    index = [g for g, size in enumerate(sizes) for _ in range(size)]
    rewards, mask = outcome_batch(scores, [1] * n, 1)
    adv, _ = algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=index)
    for g in range(len(sizes)):
        group = adv[[i for i, key in enumerate(index) if key == g], 0]
        expected = 0.0 if len(set(scores[i] for i, key in enumerate(index) if key == g)) == 1 else 1.0
        assert group.std().item() == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("name", sorted(algos.ADVANTAGE_ESTIMATORS))
def test_outputs_keep_the_input_dtype_and_accept_bool_masks(name):
    rewards, mask, index = random_batch(4)
    rewards = rewards.double()
    index = [key for key in index if key != "p2"] + ["p0"]
    if name == "spin":  # SPIN pairs the two responses of each prompt
        index = [i // 2 for i in range(len(index))]
    shared = dict(index=index, values=torch.zeros_like(rewards), reward_baselines=torch.zeros(10, dtype=torch.float64),
                  gamma=0.9, lam=0.95, old_log_prob=torch.zeros_like(rewards), ref_log_prob=torch.zeros_like(rewards))
    adv, ret = get_adv_estimator(name)(token_level_rewards=rewards, response_mask=mask.bool(), **shared)[:2]
    float_adv, _ = get_adv_estimator(name)(token_level_rewards=rewards, response_mask=mask, **shared)[:2]
    assert adv.dtype == ret.dtype == torch.float64
    assert torch.equal(adv, float_adv)
