"""The engine on image samples under torchrun (2 ranks, gloo); run by tests/engine/test_vision_engine.py.

    torchrun --nproc-per-node 2 _vision_engine_worker.py vision WORK_DIR

WORK_DIR holds the tiny Qwen2.5-VL / Qwen3-VL checkpoints and ``batch.pt`` (``{"batches": {family: RLBatch}}``,
image and text samples with old/ref log-probs and advantages). Per family and layout, rank 0 saves the log-prob
pass's log-probs (all samples, in order) and one update's metrics.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
import _engine_worker as _engine  # noqa: E402

from megarl.engine import MegatronActor, data_parallel_shard  # noqa: E402
from megarl.models import ParallelLayout, build_model  # noqa: E402

# name: (layout, packed micro-batches)
LAYOUTS = {
    "tp2_sp": (ParallelLayout(tp=2, sequence_parallel=True), True),
    "pp2_padded": (ParallelLayout(pp=2), False),
    "pp2_packed": (ParallelLayout(pp=2), True),
    "dp2": (ParallelLayout(), True),
}


def vision(work: Path, data: dict) -> dict:
    results = {}
    for family, batch in data["batches"].items():
        for name, (layout, packed) in LAYOUTS.items():
            _engine.setup(layout)
            dp_rank, dp_size = _engine.dp_coords()
            local = data_parallel_shard(batch, dp_rank, dp_size)
            actor = MegatronActor(build_model(work / family, layout, "actor"), _data.actor_settings(packed=packed))
            log_probs, _ = actor.compute_log_prob(local)
            results[f"{family}/{name}"] = {"log_probs": _engine.gather_dp(log_probs),
                                           "metrics": actor.update_policy(local)}
    return results


if __name__ == "__main__":
    _engine.run_worker_mode({"vision": vision})
