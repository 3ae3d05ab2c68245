"""The staleness rules (admission, earliest-deadline picks, feasibility) in an event simulation.

Groups finish after random, heavy-tailed latencies, so they finish out of order; the trainer takes
what the rules allow. Over many seeds and settings: no group trains more than ceil(K) versions after
it started, the trainer never waits forever, and staleness 0 with a sync per step takes exactly the
groups started after the last sync, in prompt order.
"""
from __future__ import annotations

import heapq
import math
import random

import pytest

from megarl.algorithms.staleness import Candidate, StalenessBound, expired, pick


def simulate(bound: StalenessBound, steps: int, seed: int, train_time: float = 1.0):
    rng = random.Random(seed)
    now, version, taken, next_key = 0.0, 0, 0, 0
    groups: dict[int, dict] = {}
    events: list[tuple[float, int]] = []
    picks, lags, dropped, most_ahead = [], [], 0, 0

    def admit() -> None:
        nonlocal next_key, most_ahead
        while bound.capacity(version, taken, len(groups)) > 0:
            latency = rng.paretovariate(1.5) * rng.choice([0.2, 1.0, 3.0])
            groups[next_key] = {"version": version, "deadline": bound.deadline(version), "done": False}
            heapq.heappush(events, (now + latency, next_key))
            next_key += 1
        most_ahead = max(most_ahead, len(groups))

    def finish_until(t: float) -> None:
        nonlocal now
        while events and events[0][0] <= t:
            when, key = heapq.heappop(events)
            now = max(now, when)
            if key in groups:
                groups[key]["done"] = True
        now = max(now, t)

    admit()
    for step in range(steps):
        window = step // bound.sync_every
        while True:
            if bound.strategy == "drop":
                cands = [Candidate(k, g["deadline"], g["done"]) for k, g in groups.items()]
                for key in expired(cands, window):
                    del groups[key]
                    dropped += 1
                admit()
            cands = [Candidate(k, g["deadline"], g["done"]) for k, g in groups.items()]
            chosen = pick(cands, bound.batch_groups, taken, bound)
            if chosen is not None:
                break
            assert events, f"deadlock at step {step}: nothing runs and no feasible pick ({cands})"
            finish_until(events[0][0])
        for key in chosen:
            lags.append(window - groups.pop(key)["version"])
        picks.append(sorted(chosen))
        taken += bound.batch_groups
        admit()
        finish_until(now + train_time)
        if (step + 1) % bound.sync_every == 0:
            version += 1
            admit()
    return picks, lags, dropped, most_ahead


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("sync_every", [1, 2])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("strategy", ["wait", "drop"])
def test_no_group_trains_past_the_bound_and_the_trainer_never_deadlocks(threshold, sync_every, batch, strategy):
    bound = StalenessBound(threshold, batch, sync_every, strategy)
    for seed in range(40):
        picks, lags, dropped, most_ahead = simulate(bound, steps=25, seed=seed)
        assert max(lags) <= math.ceil(threshold), (seed, max(lags))
        assert most_ahead <= math.floor((threshold + 1) * bound.window_groups + 1e-9)
        assert len({k for p in picks for k in p}) == 25 * batch  # every group trained once
        if strategy == "wait":
            assert dropped == 0


def test_out_of_order_finishes_do_train_young_groups_early():
    """A control: with a bound > 0 the picks are not the admission order (the rules matter)."""
    bound = StalenessBound(2.0, 4, 1, "wait")
    reordered = any(sorted(k for p in simulate(bound, 25, seed)[0] for k in p) !=
                    [k for p in simulate(bound, 25, seed)[0] for k in p] for seed in range(10))
    assert reordered


def test_staleness_zero_takes_the_synchronous_batches():
    bound = StalenessBound(0.0, 4, 1, "wait")
    for seed in range(20):
        picks, lags, _, _ = simulate(bound, steps=10, seed=seed)
        assert picks == [list(range(4 * s, 4 * s + 4)) for s in range(10)] and set(lags) == {0}


def test_one_step_off_takes_batches_in_prompt_order_one_version_late():
    bound = StalenessBound(1.0, 3, 1, "wait", fifo=True)
    for seed in range(20):
        picks, lags, _, _ = simulate(bound, steps=10, seed=seed)
        assert picks == [list(range(3 * s, 3 * s + 3)) for s in range(10)]
        assert lags[:3] == [0, 0, 0] and set(lags[3:]) == {1}  # batch k+1 is generated while batch k trains


def test_feasibility_waits_for_an_old_group_instead_of_breaking_the_bound():
    """K=2, W=1: three groups of version 0 start; if the trainer took only young groups while two old
    ones ran, both would be due in window 2 with one slot: the pick waits instead."""
    bound = StalenessBound(2.0, 1, 1, "wait")
    cands = [Candidate(0, 2, False), Candidate(1, 2, False), Candidate(3, 3, True)]  # step 2: two old running
    assert pick(cands, 1, taken=1, bound=bound) is None
    assert pick(cands[1:], 1, taken=1, bound=bound) == [3]  # one old running: room for both
    assert pick([Candidate(0, 2, False)], 1, 0, bound) is None  # not finished: nothing to take
