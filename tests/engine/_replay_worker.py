"""Router replay scenarios under torchrun (2 ranks, gloo); run by tests/engine/test_router_replay.py.

    torchrun --nproc-per-node 2 _replay_worker.py replay WORK_DIR

WORK_DIR holds the engine tests' checkpoints, ``batch.pt`` and ``forced.pt`` (a routing table that
sends every token to experts its router would not choose). Per layout, rank 0 saves: the table the
log-prob pass records, the log-probs replaying the forced table, and the update replaying it
(metrics and weights).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
import _engine_worker as _engine  # noqa: E402

from megarl.engine import MegatronActor, data_parallel_shard  # noqa: E402
from megarl.models import ParallelLayout, build_model  # noqa: E402

# name: (layout, packed micro-batches, megatron overrides)
LAYOUTS = {
    "tp2_sp_recompute": (ParallelLayout(tp=2, etp=2, sequence_parallel=True), True,
                         {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    "pp2_padded": (ParallelLayout(pp=2), False, {}),
    "ep2": (ParallelLayout(ep=2), True, {}),
}


def scenario(work: Path, batch, forced: torch.Tensor, layout: ParallelLayout, packed: bool, overrides: dict) -> dict:
    dp_rank, dp_size = _engine.dp_coords()
    local = data_parallel_shard(batch.with_fields(routed_experts=forced), dp_rank, dp_size)
    settings = dataclasses.replace(_data.actor_settings(packed=packed), router_replay="R3")
    actor = MegatronActor(build_model(work / _data.MOE, layout, "actor", config_overrides=overrides), settings)
    live, _, recorded = actor.compute_log_prob(local.with_fields(routed_experts=None), record_routing=True)
    replayed, _ = actor.compute_log_prob(local)
    metrics = actor.update_policy(local)
    return {"recorded": _engine.gather_dp(recorded.int()).short(), "live_log_probs": _engine.gather_dp(live),
            "replayed_log_probs": _engine.gather_dp(replayed), "metrics": metrics,
            "weights": _engine.weights(actor.model, work / _data.MOE, layout)}


def replay(work: Path, data: dict) -> dict:
    forced = torch.load(work / "forced.pt")
    results = {}
    for name, (layout, packed, overrides) in LAYOUTS.items():
        _engine.setup(layout)
        results[name] = scenario(work, data["batches"][_data.MOE], forced, layout, packed, overrides)
    return results


if __name__ == "__main__":
    _engine.run_worker_mode({"replay": replay})
