"""Room for a checkpoint: checked before a save, and named when a save runs out of it.

A save into a full filesystem fails inside torch's zip writer with ``[enforce fail at
inline_container.cc:672] . unexpected pos 704 vs 598``, which says nothing of space, and leaves a
broken staging directory that fills what little room the logs had. So ``save_checkpoint`` first
compares the free space under the checkpoint root with the size of the previous checkpoint there
(the next one holds the same parts, so it is the best estimate) and refuses a save that cannot fit,
before writing anything; the previous checkpoint stays intact. When a save fails anyway (the first
one, with nothing to compare, or another writer filled the disk), ``out_of_space`` turns the error
into one that names the path, the free space and what was needed.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from megarl.logging.progress import directory_bytes, human

NEARLY_FULL_BYTES = 64 * 2**20  # after a failed write, less than this free means the disk filled up


class CheckpointSpaceError(OSError):
    """Not enough free space for a checkpoint (``errno.ENOSPC``)."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # pickled to the other ranks: rebuilt from the message alone
        return type(self), (self.strerror,)


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_room(root: str | os.PathLike, step: int, previous: Path | None) -> None:
    """Refuse (``CheckpointSpaceError``) a save of ``step`` under ``root`` when the previous checkpoint
    there would not fit in the free space; no estimate without one."""
    if previous is None:
        return
    needed, free = directory_bytes(previous), free_bytes(root)
    if free < needed:
        raise CheckpointSpaceError(
            f"No space left for checkpoint step {step}: {root} has {human(free, 'B')} free, the previous checkpoint "
            f"{previous} took {human(needed, 'B')}; nothing was written and {previous.name} is intact. Free "
            f"{human(needed - free, 'B')} or more there (e.g. lower trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep) "
            "or point trainer.default_local_dir at a larger disk, then resume")


def _is_no_space(exc: BaseException) -> bool:
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def out_of_space(exc: BaseException, staging: Path, previous: Path | None) -> CheckpointSpaceError | None:
    """A clear error when the failed save ``exc`` ran out of space (None when it did not)."""
    free = free_bytes(staging)
    if not _is_no_space(exc) and free >= NEARLY_FULL_BYTES:
        return None
    written = directory_bytes(staging) if staging.exists() else 0
    needed = f"the previous checkpoint {previous} took {human(directory_bytes(previous), 'B')}" if previous is not None \
        else f"{human(written, 'B')} were written when it filled, and the checkpoint needs more"
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return CheckpointSpaceError(
        f"No space left on device while writing {staging}: {human(free, 'B')} free there; {needed}. The partial "
        f"checkpoint was removed; {'the previous one is intact' if previous is not None else 'there is no earlier one'}. "
        f"Free space (or point trainer.default_local_dir at a larger disk), then resume. (The write failed with: "
        f"{lines[-1].strip()[:200]})")
