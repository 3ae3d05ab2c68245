"""Reading a checkpoint runs no code from it.

A megatron-core torch_dist checkpoint holds three kinds of pickles, and unpickling can call any
importable function (a crafted file runs a shell command as it loads):

* ``.metadata``, torch.distributed.checkpoint's index of the tensors, which torch reads with plain
  ``pickle.load``;
* ``common.pt``, the state saved once (LR schedule, the caller's ``extra``), which megatron reads
  with ``torch.load`` without ``weights_only`` (so ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns the
  restriction off);
* ShardedObjects inside the ``__*_*.distcp`` files (megarl's RNG states, Transformer Engine's extra
  state), which torch's load planner reads with ``torch.load(weights_only=False)``.

While ``safe_unpickling()`` is active (megarl enters it around every checkpoint read), the three
are restricted: ``.metadata`` to the classes the format is made of (``METADATA_GLOBALS``, found by
recording what megatron-core 0.16.1 on torch 2.13 writes), ``common.pt`` to torch's
``weights_only`` set (tensors and plain Python data), ShardedObjects to that set plus NumPy's array
reconstruction (the NumPy RNG state is an array). Anything else raises ``UnsafeCheckpointError``
naming the file and the global it asked for, before that global is imported or called.
"""
from __future__ import annotations

import io
import pickle
import re
from contextlib import contextmanager
from pathlib import Path

import torch

METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    # megatron keeps the save plans (``all_local_plans``) in the metadata
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "BytesIOWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},  # torch.strided and the other layouts
    "torch": {"Size"},  # and every torch dtype (``_allowed``)
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to import something a checkpoint never needs; it was not loaded."""


def _allowed(module: str, name: str) -> bool:
    if name in METADATA_GLOBALS.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"it asks for {module}.{name}")
        return super().find_class(module, name)


def load_metadata(file, path: str | Path):
    """Unpickle a ``.metadata`` file (an open binary file) with only ``METADATA_GLOBALS``."""
    try:
        return _MetadataUnpickler(file).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as exc:
        raise UnsafeCheckpointError(_refusal(path, exc, "torch.distributed.checkpoint metadata")) from None


def _refusal(path, exc: Exception, allowed: str) -> str:
    """One line: the file, what it asked for (torch's messages name the global in several forms)."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"it asks for ([\w.]+)", text)
    detail = f"it asks for {found.group(1)}" if found else text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
    return (f"{path}: refused to load ({detail}); a checkpoint file may hold only {allowed}, so this one is damaged or "
            "crafted to run code. Use a checkpoint you wrote yourself")


def _numpy_globals() -> list:
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_tensors_only(source, path: str | Path, numpy_arrays: bool = False, map_location=None):
    """``torch.load(weights_only=True)`` (and NumPy arrays if asked), naming ``path`` when refused."""
    extra = _numpy_globals() if numpy_arrays else []
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        allowed = "tensors, plain Python data" + (" and NumPy arrays" if numpy_arrays else "")
        raise UnsafeCheckpointError(_refusal(path, exc, allowed)) from None


def _read_metadata(self, *args, **kwargs):
    """``FileSystemReader.read_metadata`` with the restricted unpickler (torch 2.13's body otherwise)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as file:
        metadata = load_metadata(file, path)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` (a ShardedObject) with ``weights_only`` and NumPy arrays (tensors
    go back to the device they were saved from, as torch's own load does)."""
    from torch.distributed.checkpoint._traverse import set_element

    info = (self.metadata.storage_data or {}).get(read_item.storage_index) if self.metadata else None
    where = f"{getattr(info, 'relative_path', '?')} (object {read_item.dest_index.fqn})"
    loaded = load_tensors_only(value, Path(_CURRENT["checkpoint"] or ".") / where, numpy_arrays=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


def _load_common(self, checkpoint_dir):
    """megatron's ``TorchCommonLoadStrategy.load_common`` with ``weights_only=True``."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    path = Path(checkpoint_dir) / COMMON_STATE_FNAME
    if not path.is_file():
        raise CheckpointingException(f"Common file {path} does not exist")
    return load_tensors_only(path, path, map_location="cpu")  # as megatron loads it


_CURRENT: dict = {"checkpoint": None, "depth": 0}


def _patch_points() -> list[tuple[type, str, object]]:
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return [(FileSystemReader, "read_metadata", _read_metadata), (DefaultLoadPlanner, "load_bytes", _load_bytes),
            (TorchCommonLoadStrategy, "load_common", _load_common)]


@contextmanager
def safe_unpickling(checkpoint: str | Path | None = None):
    """Within this block, torch's and megatron's checkpoint readers unpickle only what the format
    needs (re-entrant; ``checkpoint`` names the directory in refusals of ShardedObjects)."""
    points = _patch_points()
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in points]
    outer = _CURRENT["checkpoint"]
    _CURRENT["depth"] += 1
    _CURRENT["checkpoint"] = str(checkpoint) if checkpoint is not None else outer
    for owner, name, replacement in points:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        _CURRENT["depth"] -= 1
        _CURRENT["checkpoint"] = outer
        if _CURRENT["depth"] == 0:
            for owner, name, original in originals:
                setattr(owner, name, original)
