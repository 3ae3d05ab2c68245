"""ResumableBatchSampler / PromptDataLoader: epochs, drop_last, exact resume."""
from __future__ import annotations

import json

import pytest
from tests.data.data_helpers import verl_row, write_parquet

from megarl.data import PromptDataLoader, PromptDataset, ResumableBatchSampler


def _take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_each_epoch_is_a_fresh_permutation_in_full_batches():
    sampler = ResumableBatchSampler(10, 3, shuffle=True, seed=7, drop_last=True)
    assert len(sampler) == 3
    epochs = [sum(_take(sampler, 3), []) for _ in range(3)]
    for order in epochs:
        assert len(order) == 9 and len(set(order)) == 9 and set(order) <= set(range(10))
    assert epochs[0] != epochs[1] != epochs[2]
    # the same seed gives the same sequence; another seed a different one
    again = ResumableBatchSampler(10, 3, shuffle=True, seed=7)
    assert sum(_take(again, 9), []) == sum(epochs, [])
    other = ResumableBatchSampler(10, 3, shuffle=True, seed=8)
    assert sum(_take(other, 3), []) != epochs[0]


def test_no_shuffle_and_keep_last_partial_batch():
    sampler = ResumableBatchSampler(7, 3, shuffle=False, drop_last=False)
    assert len(sampler) == 3
    assert _take(sampler, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 4, 5, 7, 11])
def test_resume_continues_with_exactly_the_next_batch(cut):
    total = 12  # 4 epochs of 3 batches: the cuts fall inside epochs and on epoch boundaries
    uninterrupted = _take(ResumableBatchSampler(11, 3, seed=5), total)

    first = ResumableBatchSampler(11, 3, seed=5)
    before = _take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))  # as it would be stored in a checkpoint
    resumed = ResumableBatchSampler(11, 3, seed=5)
    resumed.load_state_dict(state)
    after = _take(resumed, total - cut)
    assert before + after == uninterrupted


def test_resume_with_other_settings_is_refused():
    state = ResumableBatchSampler(10, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="batch_size=2 but this run has batch_size=5"):
        ResumableBatchSampler(10, 5, seed=1).load_state_dict(state)


def test_dataset_smaller_than_a_batch():
    with pytest.raises(ValueError, match="fewer than one batch of 8"):
        ResumableBatchSampler(5, 8, drop_last=True)


def test_loader_resume_gives_the_same_prompts(tmp_path, tokenizer):
    rows = [verl_row(f"question {i}?", str(i), i) for i in range(9)]
    dataset = PromptDataset(write_parquet(rows, tmp_path / "t.parquet"), tokenizer)

    reference = PromptDataLoader(dataset, 4, seed=3)
    expected = [[item.ground_truth for item in reference.next_batch().items] for _ in range(5)]

    loader = PromptDataLoader(dataset, 4, seed=3)
    got = [[item.ground_truth for item in loader.next_batch().items] for _ in range(3)]
    resumed = PromptDataLoader(dataset, 4, seed=3)
    resumed.load_state_dict(loader.state_dict())
    batch = resumed.next_batch()
    assert (batch.epoch, batch.position) == (1, 1)
    got.append([item.ground_truth for item in batch.items])
    got.append([item.ground_truth for item in resumed.next_batch().items])
    assert got == expected
