"""Batches, micro-/mini-batching and packing: pure functions, checked against straightforward
loops and brute force (no processes, no megatron)."""

import pytest
import torch

from megarl.engine import RLBatch, data_parallel_shard, fixed_micro_batches, mini_batches, restore_order, token_budget_micro_batches
from megarl.engine.packing import gather_response, pack, pad_to


def padded_cost(lengths, part):
    return len(part) * max(lengths[i] for i in part)


def set_partitions(items):
    """Every partition of ``items`` into non-empty groups (for brute force on small inputs)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def test_fixed_micro_batches_are_even_consecutive_groups():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_micro_batches(4, 4) == [[0, 1, 2, 3]]
    assert fixed_micro_batches(10, 4) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert fixed_micro_batches(4, 4, count=2) == [[0, 1], [2, 3]]  # as many forwards as another rank
    with pytest.raises(ValueError):
        fixed_micro_batches(4, 1, count=2)


@pytest.mark.parametrize("seed", range(6))
def test_token_budget_uses_the_fewest_micro_batches_and_respects_the_budget(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (7,), generator=generator).tolist()
    budget = max(lengths) + int(torch.randint(0, 30, (1,), generator=generator))
    parts = token_budget_micro_batches(lengths, budget)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert all(padded_cost(lengths, part) <= budget for part in parts)
    fewest = min(len(p) for p in set_partitions(list(range(len(lengths)))) if all(padded_cost(lengths, g) <= budget for g in p))
    assert len(parts) == fewest


def test_token_budget_balances_without_adding_micro_batches():
    lengths = [4, 4, 4, 4, 4, 4]
    parts = token_budget_micro_batches(lengths, max_tokens=20)
    costs = [padded_cost(lengths, part) for part in parts]
    assert costs == [12, 12]  # filling up to the budget first would give 20 + 4


def test_token_budget_with_a_required_count():
    lengths = [5, 4, 3, 3, 2, 1]
    parts = token_budget_micro_batches(lengths, max_tokens=100, count=4)
    assert len(parts) == 4 and sorted(i for part in parts for i in part) == list(range(6))
    with pytest.raises(ValueError, match="too few"):
        token_budget_micro_batches(lengths, max_tokens=5, count=2)
    with pytest.raises(ValueError, match="raise it to at least"):
        token_budget_micro_batches([3, 9], max_tokens=8)


def test_restore_order_undoes_any_split():
    parts = [[3, 0], [4], [1, 2]]
    results = torch.cat([torch.tensor(part) * 10 for part in parts])
    assert results[restore_order(parts)].tolist() == [0, 10, 20, 30, 40]
    with pytest.raises(ValueError):
        restore_order([[0, 1], [1]])


def test_mini_batches_cover_every_epoch_and_shuffle_reproducibly():
    assert mini_batches(6, 4) == [[0, 1, 2, 3], [4, 5]]
    shuffled = mini_batches(8, 4, epochs=2, shuffle=True, seed=3)
    assert len(shuffled) == 4
    assert sorted(shuffled[0] + shuffled[1]) == list(range(8)) and sorted(shuffled[2] + shuffled[3]) == list(range(8))
    assert shuffled[:2] != shuffled[2:]  # each epoch draws its own order
    assert shuffled == mini_batches(8, 4, epochs=2, shuffle=True, seed=3)


def make_batch():
    """Row 0: prompt [5, 6] (left-padded), response [7, 8, 9]; row 1: prompt [4], response [3] + padding."""
    prompts = torch.tensor([[0, 5, 6], [0, 0, 4]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    responses = torch.tensor([[7, 8, 9], [3, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return RLBatch.from_parts(prompts, prompt_mask, responses, response_mask, advantages=torch.ones(2, 3))


def test_pack_left_aligns_real_tokens_and_points_at_the_predicting_positions():
    batch = make_batch()
    packed = pack(batch, multiple_of=4)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [4, 3, 0, 0, 0, 0, 0, 0]]
    assert packed.position_ids[0, :5].tolist() == [0, 1, 2, 3, 4] and packed.position_ids[1, :2].tolist() == [0, 1]
    for row in range(len(batch)):  # a straightforward loop: the output before each response token
        real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        for k in range(batch.response_length):
            if batch.attention_mask[row, batch.prompt_length + k]:
                position = real.index(int(batch.responses[row, k]), batch.attention_mask[row, : batch.prompt_length].sum().item())
                assert packed.response_index[row, k] == position - 1
    assert packed.response_valid.tolist() == [[True, True, True], [True, False, False]]
    scores = torch.arange(16.0).reshape(2, 8)
    assert gather_response(scores, packed)[0].tolist() == [1.0, 2.0, 3.0]
    grown = pad_to(packed, rows=3, length=10)
    assert grown.tokens.shape == (3, 10) and torch.equal(grown.tokens[:2, :8], packed.tokens)


def test_batch_selects_shards_and_rejects_bad_input():
    batch = make_batch()
    assert batch.responses.tolist() == [[7, 8, 9], [3, 0, 0]]
    assert batch.select([1]).advantages.shape == (1, 3)
    assert data_parallel_shard(batch, 1, 2).input_ids.tolist() == batch.select([1]).input_ids.tolist()
    with pytest.raises(ValueError, match="padding"):
        RLBatch(batch.input_ids, batch.attention_mask, torch.ones(2, 3, dtype=torch.long))
    no_prompt = batch.attention_mask.clone()
    no_prompt[1, :3] = 0
    with pytest.raises(ValueError, match="no prompt token"):
        RLBatch(batch.input_ids, no_prompt, batch.response_mask)
    with pytest.raises(ValueError, match="needs batch.old_log_probs"):
        batch.require("old_log_probs", "advantages", purpose="update_policy")
    with pytest.raises(ValueError, match="shape of response_mask"):
        batch.with_fields(values=torch.zeros(2, 2))
