"""Transports with real processes: 4 trainer ranks (TP=2 x DP=2) -> 4 rollout workers (2 replicas x TP=2).

One spawned world runs several phases in sequence (full and shard mode, gloo's per-region
protocol and nccl's one-broadcast-per-bucket protocol (run over gloo), the colocated transport
over host shared memory, windows 1-3, many small buckets and one big one, a partial plan, and
finally a receiver killed mid-sync); each test checks one phase's saved results
against reference tensors rebuilt here from the seed. Plus the schedule's deadlock freedom,
simulated on random plans.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.planner import Piece, TensorMeta, plan_sync
from megarl.weight_sync.schedule import global_order, members, rank_schedule, route_of, routes_of
from megarl.weight_sync.transport import make_transport
from megarl.weight_sync.transport.cuda_ipc import check_colocated
from tests.weight_sync import _world
from tests.weight_sync._spawn import free_port, run_processes
from tests.weight_sync._sync_worker import participant

KILL_TIMEOUT_S = 10.0
PHASES = [
    dict(name="full", transport="gloo", mode="full", bucket_bytes=4096, window=2, seeds=[1, 2]),
    dict(name="shard_w1", transport="gloo", mode="shard", bucket_bytes=1000, window=1, seeds=[3]),
    dict(name="shard_one_bucket", transport="gloo", mode="shard", bucket_bytes=1 << 20, window=3, seeds=[4]),
    dict(name="ipc", transport="cuda_ipc", mode="full", bucket_bytes=2048, window=2, seeds=[5]),
    dict(name="broadcast", transport="gloo", per_region=False, mode="full", bucket_bytes=4096, window=2, seeds=[8]),
    dict(name="broadcast_shard", transport="gloo", per_region=False, mode="shard", bucket_bytes=1000, window=1,
         seeds=[9]),
    dict(name="partial", transport="gloo", mode="full", bucket_bytes=4096, window=2, seeds=[6], drop_bucket=0),
    dict(name="kill", transport="gloo", mode="full", bucket_bytes=1024, window=2, seeds=[7], die_rank=5),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync")
    phases = [dict(p, port=free_port(), timeout_s=KILL_TIMEOUT_S if p["name"] == "kill" else 120.0) for p in PHASES]
    codes, seconds = run_processes(participant, [(rank, phases, str(out)) for rank in range(_world.WORLD)],
                                   deadline_s=400)
    results = {}
    for phase in PHASES:
        for rank in range(_world.WORLD):
            path = out / f"{phase['name']}-{rank}.pt"
            if path.exists():
                results[(phase["name"], rank)] = torch.load(path, weights_only=False)
    return codes, seconds, results


def _clean(results, phase):
    for rank in range(_world.WORLD):
        result = results[(phase, rank)]
        assert "crash" not in result, result["crash"]
        assert "error" not in result, result["error"]
    return [results[(phase, rank)] for rank in range(_world.WORLD)]


@pytest.mark.distributed
@pytest.mark.timeout(480)
@pytest.mark.parametrize("phase", ["full", "shard_w1", "shard_one_bucket", "ipc", "broadcast", "broadcast_shard"])
def test_receivers_assemble_bit_exact_tensors(world, phase):
    _, _, results = world
    spec = next(p for p in PHASES if p["name"] == phase)
    plan = _world.make_plan(spec["mode"], spec["bucket_bytes"])
    per_rank = _clean(results, phase)
    for sync, seed in enumerate(spec["seeds"]):
        ref = _world.reference(seed)
        sent = sum(per_rank[r]["syncs"][sync]["stats"].bytes_sent for r in _world.SOURCES)
        assert sent == plan.bytes_sent  # each byte leaves one source once
        for rank in _world.RECEIVERS:
            got = per_rank[rank]["syncs"][sync]
            assert got["committed"]
            assert sorted(got["tensors"]) == sorted(_world.TENSORS)
            assert len(got["order"]) == len(set(got["order"]))  # each tensor handed out once
            assert got["stats"].bytes_received == sum(b.nbytes for b in plan.buckets if rank in b.dsts)
            for name, tensor in got["tensors"].items():
                assert tensor.dtype == ref[name].dtype and tensor.shape == ref[name].shape
                region = _world.expected_region(name, spec["mode"], rank)
                assert torch.equal(tensor[region], ref[name][region]), (phase, rank, name)


def test_shard_mode_moves_half_of_full_mode():
    full = _world.make_plan("full", 4096)
    shard = _world.make_plan("shard", 4096)
    assert shard.bytes_sent == full.bytes_sent  # every element leaves once in both modes
    # norms are replicated on the rollout side; everything else reaches each worker only in part
    assert shard.bytes_delivered < 0.6 * full.bytes_delivered


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_partial_plan_fails_the_receivers(world):
    _, _, results = world
    per_rank = [results[("partial", r)] for r in range(_world.WORLD)]
    dropped = _world.make_plan("full", 4096).buckets[0]
    for rank in _world.SOURCES:
        assert "error" not in per_rank[rank] and "crash" not in per_rank[rank]
    for rank in _world.RECEIVERS:
        sync = per_rank[rank]["syncs"][0]
        assert "error" in sync, sync
        assert not sync["committed"]
        for name in {t.name for t in dropped.transfers}:
            assert name in sync["error"]


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_killed_receiver_fails_the_sync_fast_and_is_named(world):
    codes, _, results = world
    assert None not in codes, f"a process hung: exit codes {codes}"  # the harness deadline proves no hang
    assert codes[5] == 17  # the receiver that died mid-sync
    assert all(code == 0 for rank, code in enumerate(codes) if rank != 5), codes
    for rank in _world.SOURCES:
        result = results[("kill", rank)]
        assert "crash" not in result, result.get("crash")
        message = result.get("error") or str(result["syncs"])
        silent = re.search(r"silent peer ranks \(no heartbeat, dead or frozen\): \[([\d, ]+)\]", message)
        assert silent and 5 in [int(r) for r in silent.group(1).split(",")], message
        assert result["seconds"] < KILL_TIMEOUT_S + 10
    for rank in (4, 6, 7):  # the surviving receivers do not commit
        result = results[("kill", rank)]
        sync = result["syncs"][0] if result["syncs"] else {}
        assert "error" in sync or "error" in result, result
        assert result["seconds"] < KILL_TIMEOUT_S + 15


# ---------------------------------------------------------------- the schedule, without processes
def _simulate(plan, window, order_of=rank_schedule):
    """Reference model of the rule: post op i after op i-window completed; an op completes once
    all members posted it and it is next on its route. Returns the number of completed ops."""
    ranks = sorted({r for b in plan.buckets for r in (b.src, *b.dsts)})
    todo = {r: list(order_of(plan, r)) for r in ranks}
    posted = {r: [] for r in ranks}
    done: set[int] = set()
    route_queue = {route: [i for i in global_order(plan) if route_of(plan.buckets[i]) == route]
                   for route in routes_of(plan)}
    progress = True
    while progress:
        progress = False
        for r in ranks:  # post while the window allows
            while todo[r] and sum(1 for i in posted[r] if i not in done) < window:
                posted[r].append(todo[r].pop(0))
                progress = True
        for route, queue in route_queue.items():
            while queue and all(queue[0] in posted[m] for m in members(route)):
                done.add(queue.pop(0))
                progress = True
    return len(done)


def _random_plan(rng):
    shapes = {f"w{i}": (rng.choice([4, 8, 12]), rng.choice([4, 8])) for i in range(rng.randint(2, 5))}
    meta = {n: TensorMeta(s, 4) for n, s in shapes.items()}
    n_src, n_dst = rng.randint(1, 4), rng.randint(1, 4)
    sources = [Piece(r, n, ((0, s[0]), (0, s[1]))) for n, s in shapes.items() for r in range(n_src)
               if rng.random() < 0.7 or r == 0]
    needs = []
    for d in range(n_dst):
        for n, s in shapes.items():
            half = rng.choice([None, 0, 1])
            region = ((0, s[0]), (0, s[1])) if half is None else ((half * s[0] // 2, (half + 1) * s[0] // 2), (0, s[1]))
            needs.append(Piece(n_src + d, n, region))
    return plan_sync(sources, needs, meta, bucket_bytes=rng.choice([16, 64, 256]))


def test_schedule_never_deadlocks_on_random_plans():
    rng = random.Random(0)
    for _ in range(200):
        plan = _random_plan(rng)
        for window in (1, 2, 3):
            assert _simulate(plan, window) == len(plan.buckets)


def test_the_simulation_does_detect_a_deadlock():
    """Two routes walked in opposite orders by their shared members deadlock at window 1."""
    meta = {"a": TensorMeta((4,), 4), "b": TensorMeta((4,), 4)}
    plan = plan_sync([Piece(0, "a", ((0, 4),)), Piece(1, "b", ((0, 4),))],
                     [Piece(2, "a", ((0, 4),)), Piece(3, "a", ((0, 4),)), Piece(2, "b", ((0, 4),)),
                      Piece(3, "b", ((0, 4),))], meta, 1 << 10)
    assert _simulate(plan, 1) == 2
    reversed_for_3 = lambda p, r: rank_schedule(p, r)[::-1] if r == 3 else rank_schedule(p, r)  # noqa: E731
    assert _simulate(plan, 1, reversed_for_3) == 0


def test_global_order_interleaves_routes():
    meta = {"w": TensorMeta((8, 4), 4), "v": TensorMeta((8, 4), 4)}
    plan = plan_sync([Piece(0, "w", ((0, 8), (0, 4))), Piece(1, "v", ((0, 8), (0, 4)))],
                     [Piece(2, "w", ((0, 8), (0, 4))), Piece(2, "v", ((0, 8), (0, 4)))], meta, bucket_bytes=32)
    srcs = [plan.buckets[i].src for i in global_order(plan)]
    assert srcs == [0, 1] * 4  # 4 row-chunk buckets per source, alternating
    assert rank_schedule(plan, 1) == [i for i in global_order(plan) if plan.buckets[i].src == 1]
    assert sorted(global_order(plan)) == list(range(len(plan.buckets)))


def test_colocated_routes_must_share_a_host():
    routes = [(0, (2, 3)), (1, (2, 3))]
    check_colocated(routes, {0: "a", 1: "a", 2: "a", 3: "a"})
    with pytest.raises(SyncError, match=r"route 1 -> \[2, 3\] spans hosts"):
        check_colocated(routes, {0: "a", 1: "b", 2: "a", 3: "a"})


def test_run_before_connect_and_bad_names_are_clear_errors():
    plan = _world.make_plan("full", 4096)
    with pytest.raises(SyncError, match="before connect"):
        make_transport("gloo").run(plan, 0)
    with pytest.raises(ValueError, match="unknown weight-sync transport 'mpi'"):
        make_transport("mpi")
    with pytest.raises(ValueError, match="window must be >= 1"):
        make_transport("gloo", window=0)


def test_nccl_needs_cuda():
    from megarl import platform

    if platform.has_cuda():
        pytest.skip("this machine has CUDA; the guard is for CPU-only machines")
    with pytest.raises(SyncError, match="needs CUDA .* use transport 'gloo'"):
        make_transport("nccl").connect(0, 2, "127.0.0.1", 1, _world.make_plan("full", 4096), timeout_s=1)


def test_auto_picks_by_device_and_gpu_only_transports_are_refused_on_cpu():
    from megarl.weight_sync.transport import TRANSPORTS, choose_transport

    assert choose_transport("auto", use_gpu=False) == "gloo" and choose_transport("auto", use_gpu=True) == "nccl"
    assert TRANSPORTS.having(needs_gpu=True) == {"nccl", "cuda_ipc"}
    for name in ("nccl", "cuda_ipc"):
        with pytest.raises(ValueError, match=rf"transport='{name}' needs GPUs; use auto or one of \['gloo'\]"):
            choose_transport(name, use_gpu=False)
        assert choose_transport(name, use_gpu=True) == name
