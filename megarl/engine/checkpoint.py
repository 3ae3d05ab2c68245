"""Distributed checkpoints of a model, its optimizer, LR schedule and RNG states (megatron-core
``dist_checkpointing``, torch_dist format).

Resharding: model weights are saved as global tensors with their shard offsets, and the
distributed optimizer's state in megatron's ``fully_reshardable`` format (gathered over
data-parallel ranks at save time and stored like its parameter: each Adam moment a tensor of the
parameter's shape), so a checkpoint written under one TP/PP/EP/DP layout loads under another.
megatron-core 0.16.1 offers no other format that reshards TP/PP: ``dp_reshardable`` reshards
over DP only, and ``fully_sharded_model_space`` (flattened ranges) is no longer supported. The LR schedule and the caller's ``extra`` state are saved once, by rank 0.
RNG states are per model-parallel rank; they are restored only when the layout is the same
(under another layout there is no rank to take them from, and the fresh seeding stands).

Atomic writes: a checkpoint is written to ``<root>/step_<N>.tmp``, its manifest (every file's
size and SHA-256, ``manifest``) last, renamed to ``<root>/step_<N>`` when every rank has finished,
and only then does ``<root>/latest`` (written to a temporary file and renamed) name it. A crash
mid-save leaves a ``.tmp`` directory that is never loaded, and ``latest`` still names the previous
complete checkpoint. A save that would not fit in the free space (judged by the previous
checkpoint's size) is refused before anything is written (``disk_space``).

Loading checks the manifest (a damaged file is named; ``verify=False`` when the caller checked
already) and unpickles only what the format needs (``unpickling``): a crafted checkpoint cannot run code.

Contents: the model always; the optimizer, the LR schedule, the RNG states, the caller's
``extra`` and ``exports`` (e.g. an HF export written into the checkpoint directory before it is
renamed) as the caller asks. ``model_part="trainable"`` saves only the model tensors that train
(a LoRA run's adapters, and a LoRA critic's new value head): the frozen base is not copied into
every checkpoint. Loading follows the checkpoint: a trainable-only one fills exactly those tensors
(the model must have them), a whole-model one fills everything but LoRA adapters. ``megarl_checkpoint.json`` lists what a checkpoint holds, and a load
that asks for a part the checkpoint lacks fails naming what it has.

Saving is synchronous (megarl refuses asynchronous saves): megatron's writer forks its writer
processes and hands their results back through a queue in this process (``_in_process_results``),
not through the queue of a spawned ``multiprocessing.Manager`` that its default keeps for
asynchronous saves (a Python interpreter per saving process, 2.2 CPU-s and 2.5 s measured on CPU).
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megarl.engine.checkpoint_dirs import (COMMON_FILE, LATEST_FILE, META_FILE, TENSOR_INDEX_FILE,  # noqa: F401
                                          checkpoint_contents, checkpoint_dir, checkpoint_extra, checkpoint_meta,
                                          checkpoint_problems, checkpoint_tensors, latest_checkpoint, read_meta,
                                          resolve_checkpoint, step_directories)
from megarl.engine.disk_space import check_room, out_of_space
from megarl.engine.manifest import verify_checkpoint, write_manifest
from megarl.engine.optimizer import initialize_optimizer_state
from megarl.engine.unpickling import UnsafeCheckpointError, load_metadata, safe_unpickling

# Chained optimizers (dense + expert) keep their keys unprefixed, as fully reshardable formats allow.
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    from megarl.platform import device_rng_state

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": device_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    from megarl.platform import set_device_rng_state

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    set_device_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: dict[str, Any] | None):
    """This rank's RNG state as one cell of a (pp, tp, ep) grid, replicated over data parallelism."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    layout = _layout()
    shape = (layout["pp"], layout["tp"], layout["ep"])
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    replica = ps.get_data_parallel_rank(with_context_parallel=True) // layout["ep"]
    return ShardedObject("megarl.rng_state", state, shape, offset, replica_id=replica)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP: checkpoint keys are the model's own names, with or without DDP."""
    while hasattr(model, "module"):
        model = model.module
    return model


MODEL_PARTS = ("all", "trainable", "base")


def model_sharded_state(model: torch.nn.Module, part: str = "all") -> dict:
    """The model's sharded state: ``all`` of it, only the ``trainable`` tensors, or the ``base`` (all but
    LoRA adapters: what a whole-model checkpoint gives a model with adapters)."""
    from megarl.models.lora import adapter_parameters

    module = _unwrap(model)
    state = module.sharded_state_dict()
    if part == "all":
        return state
    if part == "trainable":
        keep = {id(p) for p in module.parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if id(getattr(v, "data", None)) in keep}
    adapters = {id(p) for _, p in adapter_parameters([module])}
    return {k: v for k, v in state.items() if id(getattr(v, "data", None)) not in adapters}


def _sharded_state(models: Sequence[torch.nn.Module], optimizer, scheduler, rng: bool, extra, is_loading: bool,
                   model_part: str = "all") -> dict:
    if model_part not in MODEL_PARTS:
        raise ValueError(f"model_part={model_part!r}; use one of {MODEL_PARTS}")
    state: dict[str, Any] = {f"model{i}": model_sharded_state(model, model_part) for i, model in enumerate(models)}
    if optimizer is not None:
        initialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if rng:
        state["rng"] = _rng_sharded_object(None if is_loading else _rng_state())
    if extra is not None:
        state["extra"] = extra
    return state


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    models: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    extra: dict | None = None,
    rng: bool = True,
    exports: dict[str, Callable[[Path], None]] | None = None,
    model_part: str = "all",
    meta: dict | None = None,
) -> Path:
    """Save ``<root>/step_<step>`` on every rank (collective) and point ``<root>/latest`` at it.

    ``models`` are this rank's model chunks (DDP-wrapped or not); ``extra`` is any picklable dict
    (trainer step, data loader position, KL controller, ...), saved by rank 0. ``exports`` maps a
    content name to a collective function that writes into the checkpoint directory (called on
    every rank with the staging directory, before the rename). ``model_part="trainable"`` saves
    only the tensors that train (see the module docstring); ``meta`` (JSON) is recorded in
    ``megarl_checkpoint.json`` (e.g. the LoRA settings and the base model, for the conversion).
    """
    final = checkpoint_dir(root, step)
    staging = final.with_name(final.name + ".tmp")
    previous = next((p for p in step_directories(root) if (p / META_FILE).is_file()), None)
    _same_on_every_rank(lambda: check_room(root, step, previous))
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier attempt
        staging.mkdir(parents=True)
    dist.barrier()
    try:
        _write(staging, step, models, optimizer, scheduler, extra, rng, exports, model_part, meta)
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        full = out_of_space(exc, staging, previous)
        if full is None:
            raise
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # the space it took is what the logs need
        raise full from exc
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        _write_atomically(Path(root) / LATEST_FILE, final.name + "\n")
    dist.barrier()
    return final


def _in_process_results() -> None:
    """Make megatron's torch_dist writer return its results through a ``queue.Queue`` of this process.

    Its ``FileSystemWriterAsync`` creates (once per process, cached in ``_results_queue``) a queue served
    by a spawned ``multiprocessing.Manager`` process, which an asynchronous save needs to hand results
    across processes. A synchronous save runs the whole write in the calling process (forked writers
    report through their own local queue), so a plain queue is enough and nothing is spawned.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if hasattr(filesystem_async, "_results_queue") and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _write(staging: Path, step: int, models, optimizer, scheduler, extra, rng, exports, model_part, meta) -> None:
    """Everything of a checkpoint into ``staging`` (collective): the state, the exports, the contents
    list, and last the manifest of all of them."""
    from megatron.core import dist_checkpointing

    state = _sharded_state(models, optimizer, scheduler, rng=rng, extra=extra, is_loading=False, model_part=model_part)
    _in_process_results()
    dist_checkpointing.save(state, str(staging))
    for export in (exports or {}).values():
        export(staging)
    dist.barrier()
    if dist.get_rank() == 0:
        parts = sorted(k for k in state if not k.startswith("model")) + ["model"] + sorted(exports or {})
        meta = {"step": step, "layout": _layout(), "contents": parts, "model_part": model_part, **(meta or {})}
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()
    write_manifest(staging)


def _same_on_every_rank(check: Callable[[], None]) -> None:
    """Run ``check`` on rank 0 and raise its error on every rank (no rank left waiting in a collective)."""
    error = None
    if dist.get_rank() == 0:
        try:
            check()
        except OSError as exc:
            error = exc
    box = [error]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _load_optimizer(optimizer, state) -> None:
    """``optimizer.load_state_dict(state)``, around two megatron-core 0.16.1 defects of its
    torch-Adam path (no apex / Transformer Engine; the path every CPU run takes):

    * ``DistributedOptimizer.load_state_dict`` first gives every parameter's Adam state a
      ``step`` entry, then copies the fully-reshardable parameter state into every entry,
      ``step`` included, which that format does not carry (``KeyError: 'step'``). So the groups
      and step are loaded first, and the parameters and moments are copied with ``step`` set aside.
    * It gives all parameters one shared ``step`` tensor, which torch's Adam increments in place
      once per parameter: after a resume the bias correction would use a step count hundreds of
      times too large. Every parameter gets its own copy.
    """
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [state] if len(optimizers) == 1 else [value for _, value in sorted(state.items())]
    for sub_optimizer, sub_state in zip(optimizers, states):
        param_state = sub_state.pop("param_state", None)
        kind = sub_state.pop("param_state_sharding_type", None)
        sub_optimizer.load_state_dict(sub_state)
        if param_state is None:
            continue
        if kind != OPTIMIZER_SHARDING["distrib_optim_sharding_type"]:
            raise ValueError(f"the checkpoint's optimizer state is in the {kind!r} format; megarl writes and reads fully_reshardable")
        inner = sub_optimizer.optimizer
        steps = {param: entry.pop("step") for param, entry in inner.state.items() if "step" in entry}
        try:
            sub_optimizer.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in steps.items():
                inner.state[param]["step"] = step.detach().clone()


def _refusal_inside(exc: BaseException) -> UnsafeCheckpointError | None:
    """The refusal a torch.distributed.checkpoint load wrapped in its ``CheckpointException``."""
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, UnsafeCheckpointError):
            return inner
    return None


def load_checkpoint(
    path: str | os.PathLike,
    models: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    load_rng: bool = True,
    verify: bool = True,
) -> dict | None:
    """Load a checkpoint into this rank's models (and optimizer, scheduler); returns ``extra``.

    ``path`` is a checkpoint directory or a root with a ``latest`` marker. Collective: every rank
    calls it. The layout may differ from the one the checkpoint was saved under. The files are first
    checked against the manifest (``verify=False``: the caller has done it); a damaged one raises
    ``CheckpointIntegrityError`` before any tensor is loaded.
    """
    from megarl.models.lora import has_adapters

    path = resolve_checkpoint(path)
    if verify:
        verify_checkpoint(path)
    meta = read_meta(path)
    same_layout = meta["layout"] == _layout()
    asked = {"optimizer": optimizer is not None, "scheduler": scheduler is not None, "rng": load_rng}
    missing = [part for part, wanted in asked.items() if wanted and part not in meta["contents"]]
    if missing:
        raise ValueError(f"{path} holds {meta['contents']}, not {missing}; load without them "
                         f"({', '.join(f'{m}=None' if m != 'rng' else 'load_rng=False' for m in missing)})")
    with_rng = load_rng and same_layout
    saved_part = meta.get("model_part", "all")
    if saved_part == "trainable" and not has_adapters(models):
        raise ValueError(f"{path} holds only the trained tensors of a LoRA run (the adapters), not a whole model; "
                         "load it into a model with the same LoRA settings (actor_rollout_ref.model.lora.*), or convert "
                         "it with its base model: python -m conversion megatron-to-hf --checkpoint ... --hf-config BASE")
    part = saved_part if saved_part == "trainable" else ("base" if has_adapters(models) else "all")
    if part == "base" and optimizer is not None:
        raise ValueError(f"{path} is a whole-model checkpoint: it has no optimizer state for LoRA adapters; load it as "
                         "the base model only (optimizer=None), e.g. as dist_checkpointing_path")
    state = _sharded_state(models, optimizer, scheduler, rng=with_rng, extra=None, is_loading=True, model_part=part)
    loaded = _load_state(state, path)
    for i, model in enumerate(models):
        result = _unwrap(model).load_state_dict(loaded[f"model{i}"], strict=part == "all")
        if part != "all" and result.unexpected_keys:
            raise ValueError(f"{path}: tensors the model does not have: {result.unexpected_keys[:5]}")
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if with_rng:
        _set_rng_state(loaded["rng"])
    return loaded.get("extra")


def _load_state(state: dict, path: Path) -> dict:
    """``dist_checkpointing.load`` restricted to what the format needs; a refusal is raised as itself."""
    from megatron.core import dist_checkpointing

    with open(path / TENSOR_INDEX_FILE, "rb") as index:  # refused here, by name: torch's load would reword it
        load_metadata(index, path / TENSOR_INDEX_FILE)
    try:
        with safe_unpickling(path):
            return dist_checkpointing.load(state, str(path))
    except CheckpointException as exc:  # a BaseException: what the ranks raised, wrapped
        refusal = _refusal_inside(exc)
        if refusal is None:
            raise
        raise UnsafeCheckpointError(str(refusal)) from None
