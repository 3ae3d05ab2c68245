"""Batches, micro-/mini-batching and packing: pure functions, checked against straightforward
loops and brute force (no processes; megatron only for its ``PackedSeqParams``)."""

import pytest
import torch

from megarl.engine import RLBatch, data_parallel_shard, fixed_micro_batches, mini_batches, restore_order, token_budget_micro_batches
from megarl.engine.packing import gather_response, packed_lengths, packed_row, pad_to, padded_rows, scatter_response


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


def test_padded_rows_left_align_real_tokens_and_point_at_the_predicting_positions():
    batch = make_batch()
    packed = padded_rows(batch, multiple_of=4)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [4, 3, 0, 0, 0, 0, 0, 0]]
    assert packed.position_ids[0, :5].tolist() == [0, 1, 2, 3, 4] and packed.position_ids[1, :2].tolist() == [0, 1]
    for row in range(len(batch)):  # a straightforward loop: the output before each response token
        real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        for k in range(batch.response_length):
            if batch.attention_mask[row, batch.prompt_length + k]:
                position = real.index(int(batch.responses[row, k]), batch.attention_mask[row, : batch.prompt_length].sum().item())
                assert packed.response_index[row, k] == row * 8 + position - 1
    assert packed.response_valid.tolist() == [[True, True, True], [True, False, False]]
    scores = torch.arange(16.0).reshape(2, 8)
    assert gather_response(scores, packed).tolist() == [1.0, 2.0, 3.0, 8.0]  # padding is never picked
    assert scatter_response(gather_response(scores, packed), packed).tolist() == [[1.0, 2.0, 3.0], [8.0, 0.0, 0.0]]
    grown = pad_to(packed, rows=3, length=10)
    assert grown.tokens.shape == (3, 10) and torch.equal(grown.tokens[:2, :8], packed.tokens)
    assert gather_response(torch.arange(30.0).reshape(3, 10), grown).tolist() == [1.0, 2.0, 3.0, 10.0]


def test_packed_row_holds_only_real_tokens_with_restarting_positions():
    """Sample 0 (5 real tokens) then sample 1 (2): one row, cu_seqlens [0, 5, 7], positions restarting,
    each response token scored at the packed position before it."""
    batch = make_batch()
    packed = packed_row(batch)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 4, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    params = packed.packed_seq_params
    assert params.qkv_format == "thd" and params.cu_seqlens_q_padded.tolist() == [0, 5, 7] and params.max_seqlen_q == 5
    assert packed.global_length == 7
    scores = torch.arange(7.0).reshape(1, 7)
    assert scatter_response(gather_response(scores, packed), packed).tolist() == [[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]]
    # sequence parallelism over 4 ranks: the last sample grows to 5 + 3 = 8 tokens; TE keeps the real lengths
    grown = packed_row(batch, multiple_of=4)
    assert grown.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 5, 8]
    assert grown.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 7]


def test_context_parallel_ranks_hold_their_chunks_and_score_every_response_token_once():
    """CP=2: samples padded to 8 and 4 tokens (2 x CP chunks each); rank r holds chunks r and 3 - r."""
    batch = make_batch()
    assert packed_lengths(batch, cp_size=2) == [8, 4]
    assert packed_lengths(batch, cp_size=2, multiple_of=2) == [8, 4]
    assert packed_lengths(batch, cp_size=2, multiple_of=4) == [8, 8]
    whole = torch.tensor([5, 6, 7, 8, 9, 0, 0, 0, 4, 3, 0, 0])
    scored = torch.zeros(2, 3)
    for rank, chunks in ((0, [0, 1, 6, 7, 8, 11]), (1, [2, 3, 4, 5, 9, 10])):
        packed = packed_row(batch, cp_size=2, cp_rank=rank)
        assert packed.tokens[0].tolist() == whole[chunks].tolist()
        assert packed.position_ids[0].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3][c] for c in chunks]
        global_index = torch.tensor(chunks, dtype=torch.float32).reshape(1, -1)
        scored += scatter_response(gather_response(global_index, packed), packed)  # CP=1 group: no sum
        assert packed.global_length == 12
    assert scored.tolist() == [[1.0, 2.0, 3.0], [8.0, 0.0, 0.0]]


def lpt_gap_ok(lengths, parts):
    loads = [sum(lengths[i] for i in part) for part in parts]
    return max(loads) - min(loads) <= max(lengths)


@pytest.mark.parametrize("seed", range(6))
def test_packed_token_budget_counts_real_tokens_and_balances_them(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (7,), generator=generator).tolist()
    budget = max(lengths) + int(torch.randint(0, 30, (1,), generator=generator))
    parts = token_budget_micro_batches(lengths, budget, packed=True)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in part) <= budget for part in parts)
    fewest = min(len(p) for p in set_partitions(list(range(len(lengths)))) if all(sum(lengths[i] for i in g) <= budget for g in p))
    assert fewest <= len(parts) <= fewest + 1 and lpt_gap_ok(lengths, parts)
    padded = token_budget_micro_batches(lengths, budget)
    assert len(parts) <= len(padded)  # real tokens never need more micro-batches than padded ones
    more = token_budget_micro_batches(lengths, budget, count=len(lengths), packed=True)
    assert sorted(len(p) for p in more) == [1] * len(lengths)


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
