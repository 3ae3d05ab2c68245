"""The order in which every participant of a sync takes part in the buckets, and why it cannot deadlock.

Terms. A *route* is a bucket's ``(src, dsts)``; its *members* are ``sorted({src, *dsts})``. Each
route gets its own communicator (process group), created by its members only. A bucket is
one *op* on its route's communicator: a broadcast from ``src`` to ``dsts``.

The global order. ``global_order(plan)`` is one fixed sequence of all buckets, a pure function
of the plan, so every participant computes the same one without talking. It takes the
planner's buckets route by route and interleaves the routes round-robin (the first bucket of
every route, then the second of every route, ...). Any common order would be correct; the
round-robin one lets different sources and different destination sets progress side by side
(a route-major order would make source 1 wait until the receivers are done with source 0).

The rule. Each participant walks the global order filtered to the buckets it takes part in
(``rank_schedule``) and keeps at most ``window`` of its ops in flight: it posts op ``i``
(asynchronously) only after its op ``i - window`` has completed. Work done between posting and
completing (packing the next bucket on a source, unpacking/assembling the previous bucket on a
receiver) overlaps the transfers in flight.

Why this cannot deadlock. Suppose some ops never complete and let ``X`` be the first of them in
the global order. Take any member ``m`` of ``X``'s route. Every op ``m`` posts before ``X``
precedes ``X`` in the global order, so it completes (``X`` is the first that does not); the
work ``m`` does between ops (pack, unpack, a callback) is local and finite. So ``m`` is never
stuck before ``X``: it reaches ``X`` and posts it, whatever its window (>= 1). Hence every member
posts ``X``. On ``X``'s communicator every member posts its ops in the same order (the global
order restricted to that route), and all of them before ``X`` have completed, so ``X`` is the
next op there and all members have posted it: it completes. Contradiction; every op completes
(as long as every participant is alive, which the transport's timeouts turn into an error).
Creating the communicators follows the same argument, in ``routes_of`` order.
"""
from __future__ import annotations

from itertools import zip_longest

from megarl.weight_sync.planner import Bucket, SyncPlan

Route = tuple[int, tuple[int, ...]]


def route_of(bucket: Bucket) -> Route:
    return bucket.src, tuple(bucket.dsts)


def members(route: Route) -> tuple[int, ...]:
    """Sync ranks of a route's communicator, sorted; group rank ``k`` is ``members[k]``."""
    src, dsts = route
    if src in dsts:
        raise ValueError(f"route {src} -> {list(dsts)}: a rank cannot send to itself")
    return tuple(sorted({src, *dsts}))


def routes_of(plan: SyncPlan, rank: int | None = None) -> list[Route]:
    """The plan's distinct routes (only those ``rank`` is a member of, if given), sorted."""
    routes = {route_of(b) for b in plan.buckets}
    if rank is not None:
        routes = {r for r in routes if rank in members(r)}
    return sorted(routes)


def global_order(plan: SyncPlan) -> list[int]:
    """Indices into ``plan.buckets``: routes interleaved round-robin, each route's buckets in plan order."""
    per_route: dict[Route, list[int]] = {}
    for index, bucket in enumerate(plan.buckets):
        per_route.setdefault(route_of(bucket), []).append(index)
    lanes = [per_route[r] for r in sorted(per_route)]
    return [i for column in zip_longest(*lanes) for i in column if i is not None]


def rank_schedule(plan: SyncPlan, rank: int) -> list[int]:
    """The buckets ``rank`` sends or receives, in global order."""
    return [i for i in global_order(plan) if rank == plan.buckets[i].src or rank in plan.buckets[i].dsts]
