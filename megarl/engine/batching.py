"""Splitting a batch into mini-batches (one optimizer step each) and micro-batches (one forward each).

All functions work on sample indices, so results can be put back in the original order with
``restore_order``.

Micro-batches come in two kinds:

* fixed count: ``micro_batch_size`` samples each (``ppo_micro_batch_size_per_gpu``);
* a token budget (``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``). Packed micro-batches
  (``use_remove_padding``) cost their real tokens: ``token_budget_micro_batches(..., packed=True)``
  deals the samples, longest first, to the least-filled of as few micro-batches as the budget
  allows (the LPT rule), so the micro-batches carry even token counts. Padded micro-batches cost
  ``samples x longest``: the sorted length list is cut into as few runs as the budget allows
  (similar lengths together: little padding), then the runs' costs are evened out without adding
  micro-batches.
"""
from __future__ import annotations

import heapq

import torch


def fixed_micro_batches(num_samples: int, micro_batch_size: int, count: int | None = None) -> list[list[int]]:
    """Consecutive groups of at most ``micro_batch_size`` samples, as even as possible.

    ``count`` (at least the ``ceil(num_samples / micro_batch_size)`` groups needed) asks for more,
    smaller groups, e.g. so that every data-parallel rank runs the same number of forwards.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro batch size must be >= 1, got {micro_batch_size}")
    needed = -(-num_samples // micro_batch_size)
    count = needed if count is None else count
    if not needed <= count <= num_samples:
        raise ValueError(f"cannot split {num_samples} samples into {count} micro-batches of at most {micro_batch_size}")
    return [part.tolist() for part in torch.arange(num_samples).tensor_split(count)]


def _padded_cost(sorted_lengths: list[int], start: int, stop: int) -> int:
    """Tokens of samples ``start:stop`` of a descending list once padded to the longest (the first)."""
    return (stop - start) * sorted_lengths[start]


def _cut_sorted(sorted_lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Greedy runs of a descending length list, each costing at most ``budget`` padded tokens."""
    runs, start = [], 0
    while start < len(sorted_lengths):
        stop = start + 1
        while stop < len(sorted_lengths) and _padded_cost(sorted_lengths, start, stop + 1) <= budget:
            stop += 1
        runs.append((start, stop))
        start = stop
    return runs


def _split_costliest(sorted_lengths: list[int], runs: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """Split the costliest multi-sample runs in two until there are ``count`` runs."""
    runs = list(runs)
    while len(runs) < count:
        splittable = [run for run in runs if run[1] - run[0] > 1]
        if not splittable:
            raise ValueError(
                f"cannot make {count} micro-batches from {len(sorted_lengths)} samples; every data-parallel rank "
                "needs at least as many samples as the largest micro-batch count of any rank"
            )
        start, stop = max(splittable, key=lambda run: _padded_cost(sorted_lengths, *run))
        middle = (start + stop) // 2
        position = runs.index((start, stop))
        runs[position : position + 1] = [(start, middle), (middle, stop)]
    return runs


def _lpt(lengths: list[int], members: list[int], parts: int) -> list[list[int]]:
    """``members`` (sample indices) dealt longest first to the least-filled of ``parts`` groups."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, g) for g in range(parts)]
    for index in sorted(members, key=lambda i: (-lengths[i], i)):
        total, g = heapq.heappop(heap)
        groups[g].append(index)
        heapq.heappush(heap, (total + lengths[index], g))
    return [sorted(group) for group in groups if group]


def _packed_micro_batches(lengths: list[int], max_tokens: int, count: int | None) -> list[list[int]]:
    """As few LPT groups as keep every group's token sum within ``max_tokens``; then, up to ``count``,
    the fullest group split in two (which never fills a group more)."""
    parts = max(1, -(-sum(lengths) // max_tokens))
    while True:
        groups = _lpt(lengths, list(range(len(lengths))), parts)
        if max(sum(lengths[i] for i in g) for g in groups) <= max_tokens:
            break
        parts += 1
    if count is not None and count < len(groups):
        raise ValueError(f"{count} micro-batches are too few: the token budget {max_tokens} needs {len(groups)}")
    while count is not None and len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            raise ValueError(
                f"cannot make {count} micro-batches from {len(lengths)} samples; every data-parallel rank "
                "needs at least as many samples as the largest micro-batch count of any rank"
            )
        fullest = max(splittable, key=lambda g: (sum(lengths[i] for i in g), -g[0]))
        position = groups.index(fullest)
        groups[position : position + 1] = _lpt(lengths, fullest, 2)
    return groups


def token_budget_micro_batches(lengths: list[int] | torch.Tensor, max_tokens: int, count: int | None = None,
                               packed: bool = False) -> list[list[int]]:
    """Micro-batches of sample indices whose cost stays within ``max_tokens``: the real tokens when
    ``packed``, else the padded ``samples x longest``.

    With ``count`` (e.g. the largest count of any data-parallel rank, so that all ranks run the
    same number of forward passes) the result has exactly that many micro-batches; ``count`` must
    be at least the number the budget needs.
    """
    lengths = [int(n) for n in (lengths.tolist() if torch.is_tensor(lengths) else lengths)]
    if not lengths:
        raise ValueError("cannot split an empty batch into micro-batches")
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a sample has {longest} tokens, more than the micro-batch token budget {max_tokens} "
            "(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu, times the context-parallel size); "
            "raise it to at least that"
        )
    if packed:
        return _packed_micro_batches(lengths, max_tokens, count)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    sorted_lengths = [lengths[i] for i in order]
    runs = _cut_sorted(sorted_lengths, max_tokens)
    if count is not None and count < len(runs):
        raise ValueError(f"{count} micro-batches are too few: the token budget {max_tokens} needs {len(runs)}")
    # Even out: the smallest budget that still gives no more runs than before.
    low, high = longest, max_tokens
    while low < high:
        middle = (low + high) // 2
        if len(_cut_sorted(sorted_lengths, middle)) <= len(runs):
            high = middle
        else:
            low = middle + 1
    runs = _cut_sorted(sorted_lengths, low)
    if count is not None:
        runs = _split_costliest(sorted_lengths, runs, count)
    return [[order[i] for i in range(start, stop)] for start, stop in runs]


def mini_batches(num_samples: int, mini_batch_size: int, epochs: int = 1, shuffle: bool = False, seed: int = 0) -> list[list[int]]:
    """The sample indices of every optimizer step: ``epochs`` passes over the batch in mini-batches.

    With ``shuffle`` each epoch visits the samples in a fresh order drawn from a generator seeded
    with ``seed + epoch`` (the same on every rank, and reproducible on resume). The last
    mini-batch of an epoch is smaller when ``mini_batch_size`` does not divide the batch.
    """
    if mini_batch_size < 1 or epochs < 1:
        raise ValueError(f"mini_batch_size ({mini_batch_size}) and epochs ({epochs}) must be >= 1")
    steps = []
    for epoch in range(epochs):
        if shuffle:
            order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        else:
            order = list(range(num_samples))
        steps.extend(order[start : start + mini_batch_size] for start in range(0, num_samples, mini_batch_size))
    return steps


def balanced_partitions(lengths: list[int] | torch.Tensor, parts: int) -> list[list[int]]:
    """Sample indices in ``parts`` groups of equal size whose token totals are as even as possible.

    Longest sample first, each into the group with the smallest total that still has room (the
    LPT rule with a size limit); ties go to the lower index, so the result is deterministic. Each
    group lists its indices in ascending order. verl's ``trainer.balance_batch`` gives group ``r``
    to data-parallel rank ``r``.
    """
    lengths = [int(n) for n in (lengths.tolist() if torch.is_tensor(lengths) else lengths)]
    if parts < 1 or len(lengths) % parts:
        raise ValueError(f"{len(lengths)} samples cannot be split into {parts} equal groups")
    size = len(lengths) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    open_groups = [(0, g) for g in range(parts)]  # (token total, group) of the groups with room, a heap
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, g = heapq.heappop(open_groups)
        groups[g].append(index)
        if len(groups[g]) < size:
            heapq.heappush(open_groups, (total + lengths[index], g))
    return [sorted(group) for group in groups]


def restore_order(parts: list[list[int]]) -> torch.Tensor:
    """The permutation that puts the concatenated results of ``parts`` back in sample order.

    ``torch.cat(results_per_part)[restore_order(parts)]`` is in the original order.
    """
    flat = [i for part in parts for i in part]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError("parts must cover every sample index exactly once")
    inverse = torch.empty(len(flat), dtype=torch.long)
    inverse[torch.tensor(flat, dtype=torch.long)] = torch.arange(len(flat))
    return inverse
