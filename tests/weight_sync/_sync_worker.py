"""One participant of a multi-process sync test (started with multiprocessing spawn).

It runs the phases it is given in order; each phase connects a transport on its own port, runs
one or more syncs and closes. Sources serve their shards; receivers assemble with
``WeightReceiver.receive`` and save what they got. Results go to ``<out>/<phase>-<rank>.pt``.
"""
from __future__ import annotations

import os
import time
import traceback

import torch

from megarl.weight_sync.errors import SyncError
from megarl.weight_sync.planner import SyncPlan
from megarl.weight_sync.receiver import WeightReceiver
from megarl.weight_sync.sender import region_reader
from megarl.weight_sync.transport import make_transport
from tests.weight_sync import _world


def participant(rank: int, phases: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    for phase in phases:
        result = run_phase(rank, phase)
        torch.save(result, os.path.join(out, f"{phase['name']}-{rank}.pt"))


def run_phase(rank: int, phase: dict) -> dict:
    plan = _world.make_plan(phase["mode"], phase["bucket_bytes"])
    run_plan = plan
    if phase.get("drop_bucket") is not None:  # every participant runs a plan that lacks one bucket
        run_plan = SyncPlan([b for i, b in enumerate(plan.buckets) if i != phase["drop_bucket"]], plan.meta, plan.needs)
    transport = make_transport(phase["transport"], window=phase["window"])
    if "per_region" in phase:  # gloo carrying nccl's protocol (one packed broadcast per bucket)
        transport.per_region = phase["per_region"]
    result: dict = {"syncs": []}
    start = time.perf_counter()
    try:
        transport.connect(rank, _world.WORLD, "127.0.0.1", phase["port"], run_plan, timeout_s=phase["timeout_s"])
        receiver = WeightReceiver(plan, rank) if rank in _world.RECEIVERS else None
        for seed in phase["seeds"]:
            if receiver is None:
                stats = transport.run(run_plan, rank, get_region=region_reader(_world.local_shards(rank, seed)))
                result["syncs"].append({"stats": stats})
                continue
            received, order = {}, []
            try:
                for name, tensor in _with_fault(receiver.receive(_TransportWithPlan(transport, run_plan)),
                                                phase, rank):
                    received[name] = tensor.clone()
                    order.append(name)
            except SyncError as exc:
                result["syncs"].append({"error": str(exc), "committed": False})
                continue
            result["syncs"].append({"tensors": received, "order": order, "committed": not receiver.in_progress,
                                    "stats": receiver.last_stats})
    except SyncError as exc:
        result["error"] = str(exc)
    except Exception:  # noqa: BLE001 - an unexpected failure is reported to the test, with its traceback
        result["crash"] = traceback.format_exc()
    result["seconds"] = time.perf_counter() - start
    transport.close()
    return result


class _TransportWithPlan:
    """Runs ``transport`` with ``plan`` whatever plan the receiver passes (to test a partial plan)."""

    def __init__(self, transport, plan):
        self.transport, self.plan = transport, plan

    def run(self, plan, rank, get_region=None, on_bucket=None, recv_into=None):
        return self.transport.run(self.plan, rank, get_region, on_bucket, recv_into)


def _with_fault(items, phase: dict, rank: int):
    """Pass tensors through; the rank named in ``die_rank`` exits abruptly after its first tensor."""
    for item in items:
        yield item
        if phase.get("die_rank") == rank:
            os._exit(17)
