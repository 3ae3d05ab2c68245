"""Where a run's checkpoints are and what each holds, read without loading any tensor.

``<root>/step_<N>`` directories (``step_<N>.tmp`` while being written), ``<root>/latest`` naming the
newest complete one, ``megarl_checkpoint.json`` (step, layout, contents) in each, and the files
megatron-core writes: ``.metadata`` (torch.distributed.checkpoint's index of the tensors),
``common.pt`` (the state saved once: LR schedule, the caller's ``extra``) and ``__<rank>_<i>.distcp``
(the tensor data). Every read of a pickle here is restricted (``unpickling``) and checked against
the manifest first (``manifest``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from megarl.engine.manifest import CheckpointIntegrityError, size_problems, verify_files
from megarl.engine.unpickling import safe_unpickling

LATEST_FILE = "latest"
META_FILE = "megarl_checkpoint.json"
COMMON_FILE, TENSOR_INDEX_FILE = "common.pt", ".metadata"  # megatron's and torch's names
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step}"


def step_directories(root: str | os.PathLike) -> list[Path]:
    """The ``step_<N>`` directories under ``root`` (complete or not; ``.tmp`` ones excluded), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(p.name[5:]), p) for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """Why ``path`` cannot be loaded, found without reading tensor data: not complete, or files missing
    or of another size than its manifest records ([] when it looks whole; checksums are read at load)."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} does not exist"]
    if not (path / META_FILE).is_file():
        return [f"no {META_FILE} (an interrupted or incomplete save)"]
    return size_problems(path)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``<root>/latest`` names, or None when there is none yet."""
    marker = Path(root) / LATEST_FILE
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    if not (path / META_FILE).is_file():
        whole = [p for p in step_directories(root) if not checkpoint_problems(p)]
        instead = f"the newest complete one is {whole[0]}: pass that directory" if whole else \
            f"there is no complete checkpoint under {root}"
        raise FileNotFoundError(f"{marker} names {path}, which is not a complete checkpoint (an interrupted or "
                                f"damaged save); {instead}. Keep {marker} and the step directories as they are")
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or the one a root's ``latest`` marker names; FileNotFoundError if incomplete."""
    path = Path(path)
    if (path / LATEST_FILE).is_file():
        path = latest_checkpoint(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete megarl checkpoint (no {META_FILE}); a '.tmp' directory is an interrupted save")
    return path


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / META_FILE).read_text())
    except ValueError as exc:
        raise CheckpointIntegrityError(path, [f"{META_FILE} is unreadable ({exc})"]) from None


def checkpoint_contents(path: str | os.PathLike) -> list[str]:
    """What a checkpoint holds: ``model`` and any of ``optimizer``, ``scheduler``, ``rng``, ``extra``, exports."""
    return list(read_meta(resolve_checkpoint(path))["contents"])


def checkpoint_meta(path: str | os.PathLike) -> dict:
    """``megarl_checkpoint.json`` of a checkpoint (step, layout, contents, model part, the caller's meta)."""
    return read_meta(resolve_checkpoint(path))


def checkpoint_extra(path: str | os.PathLike) -> dict | None:
    """The ``extra`` dict a checkpoint was saved with, read without loading any tensor (``common.pt``
    alone is checked against the manifest)."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    verify_files(path, [COMMON_FILE])
    with safe_unpickling(path):
        return dist_checkpointing.load_common_state_dict(str(path)).get("extra")


def checkpoint_tensors(path: str | os.PathLike) -> dict:
    """Tensor key -> metadata (global shape, dtype) of a checkpoint, from its ``.metadata`` alone."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    verify_files(path, [TENSOR_INDEX_FILE])
    with safe_unpickling(path):
        return dist_checkpointing.load_tensors_metadata(str(path))
