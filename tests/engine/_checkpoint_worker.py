"""Checkpoint integrity scenarios in one process (gloo, TP=PP=DP=1); run by test_checkpoint_integrity.py.

    python _checkpoint_worker.py WORK_DIR ROOMY_DIR SMALL_DIR

WORK_DIR holds the engine tests' tiny checkpoints; ROOMY_DIR and SMALL_DIR are filesystems (tmpfs
mounts made by the test) with room for one checkpoint and for less than one. It measures, the test
asserts; the results go to ``WORK_DIR/checkpoint_integrity.pt``.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
from _engine_worker import actor_for, setup  # noqa: E402

import megarl.engine.checkpoint as checkpoint_module  # noqa: E402
from megarl.engine import load_checkpoint, save_checkpoint  # noqa: E402
from megarl.engine.manifest import MANIFEST_FILE, write_manifest  # noqa: E402
from megarl.models import ParallelLayout  # noqa: E402
from megarl.platform import init_distributed  # noqa: E402


class RunsCode:
    """Unpickled, it runs ``touch MARKER``: what a crafted checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def outcome(call) -> dict:
    """What ``call()`` raised (type and message), or that it returned."""
    try:
        return {"returned": call()}
    except Exception as exc:  # the scenarios expect refusals
        return {"error": type(exc).__name__, "message": str(exc)}


def first_param(actor) -> torch.Tensor:
    return next(actor.model[0].parameters()).detach().clone()


def optimizer_location(path: Path) -> tuple[str, int, int]:
    """(file, offset, length) of the first optimizer tensor in a checkpoint (from its ``.metadata``)."""
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own checkpoint, just written
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("optimizer.") and "param" in index.fqn:
            return info.relative_path, info.offset, info.length
    raise AssertionError("no optimizer tensor in the checkpoint")


def damaged_optimizer(actor, root: Path, work: Path) -> dict:
    """Same-size damage to the optimizer's fp32 master weights: named at load, nothing loaded."""
    path = save_checkpoint(root, 1, actor.model, actor.optimizer, actor.scheduler, extra={"step": 1})
    name, offset, length = optimizer_location(path)
    file = path / name
    original = file.read_bytes()
    damaged = bytearray(original)
    damaged[offset + length // 2: offset + length // 2 + 64] = b"\xff" * 64  # NaNs, same size
    file.write_bytes(bytes(damaged))
    before = first_param(actor)
    with torch.no_grad():
        next(actor.model[0].parameters()).add_(1.0)  # what a load would overwrite
    changed = first_param(actor)
    result = {"file": name, "load": outcome(lambda: load_checkpoint(root, actor.model, actor.optimizer, actor.scheduler))}
    result["untouched"] = bool(torch.equal(first_param(actor), changed))
    file.write_bytes(original)
    result["repaired_load"] = outcome(lambda: load_checkpoint(root, actor.model, actor.optimizer, actor.scheduler))
    result["restored"] = bool(torch.equal(first_param(actor), before))
    result["manifest_files"] = sorted(__import__("json").loads((path / MANIFEST_FILE).read_text())["files"])
    return result


def crafted(actor, root: Path, work: Path) -> dict:
    """Checkpoints whose unpickling would run code (the manifest rewritten to match, as an attacker
    would): a ``.metadata``, a ``common.pt`` and an RNG ShardedObject; each load must refuse."""
    results = {}
    real_rng_state = checkpoint_module._rng_state
    checkpoint_module._rng_state = lambda: {**real_rng_state(), "payload": RunsCode(work / "marker_rng")}
    try:
        rng_path = save_checkpoint(root, 2, actor.model, actor.optimizer, actor.scheduler, extra={"step": 2})
    finally:
        checkpoint_module._rng_state = real_rng_state
    results["rng"] = outcome(lambda: load_checkpoint(rng_path, actor.model, actor.optimizer, actor.scheduler))
    clean = save_checkpoint(root, 3, actor.model, actor.optimizer, actor.scheduler, extra={"step": 3})
    metadata_dir, common_dir = root / "crafted_metadata", root / "crafted_common"
    for target in (metadata_dir, common_dir):
        shutil.copytree(clean, target)
    metadata = pickle.loads((clean / ".metadata").read_bytes())
    metadata.storage_meta.modules = [RunsCode(work / "marker_metadata")]  # the rest stays valid
    (metadata_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    common = torch.load(clean / "common.pt", weights_only=False)
    common["extra"]["payload"] = RunsCode(work / "marker_common")
    torch.save(common, common_dir / "common.pt")
    for name, target in (("metadata", metadata_dir), ("common", common_dir)):
        write_manifest(target)
        results[name] = outcome(lambda: load_checkpoint(target, actor.model, actor.optimizer, actor.scheduler))
    results["markers"] = sorted(p.name for p in work.glob("marker_*"))
    return results


def legacy(actor, root: Path) -> dict:
    """A checkpoint saved before manifests (none) loads, with a one-line note."""
    path = save_checkpoint(root, 4, actor.model, actor.optimizer, actor.scheduler, extra={"step": 4})
    (path / MANIFEST_FILE).unlink()
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("megarl.engine.manifest").addHandler(handler)
    result = {"load": outcome(lambda: load_checkpoint(path, actor.model, actor.optimizer, actor.scheduler))}
    result["notes"] = notes
    return result


def full_disk(actor, roomy: Path, small: Path) -> dict:
    """A save that cannot fit is refused before writing (the previous checkpoint intact); a save that
    runs out of space mid-write says so and removes its partial files."""
    result = {"first": outcome(lambda: str(save_checkpoint(roomy, 1, actor.model, actor.optimizer, actor.scheduler)))}
    result["second"] = outcome(lambda: str(save_checkpoint(roomy, 2, actor.model, actor.optimizer, actor.scheduler)))
    result["roomy_after"] = sorted(p.name for p in roomy.iterdir())
    result["latest"] = (roomy / "latest").read_text().strip()
    result["reload"] = outcome(lambda: load_checkpoint(roomy, actor.model, actor.optimizer, actor.scheduler) or "ok")
    result["into_small"] = outcome(lambda: str(save_checkpoint(small, 1, actor.model, actor.optimizer, actor.scheduler)))
    result["small_after"] = sorted(p.name for p in small.iterdir())
    return result


def main() -> None:
    work, roomy, small = (Path(arg) for arg in sys.argv[1:4])
    init_distributed()
    setup(ParallelLayout())
    actor = actor_for(work, _data.DENSE, ParallelLayout(), _data.actor_settings())
    actor.update_policy(_data.load(work / "batch.pt")["batches"][_data.DENSE])  # real Adam state
    root = work / "integrity_checkpoints"
    shutil.rmtree(root, ignore_errors=True)
    try:
        results = {"damaged": damaged_optimizer(actor, root, work), "crafted": crafted(actor, root, work),
                   "legacy": legacy(actor, root)}
        results["helpers_alive"] = [process.name for process in multiprocessing.active_children()]  # after 4 saves
        results["full_disk"] = full_disk(actor, roomy, small)
    except Exception:
        traceback.print_exc()
        raise
    torch.save(results, work / "checkpoint_integrity.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
