"""Training plumbing shared by the actor and the critic: mcore DDP, the megatron optimizer, the LR
schedule and an optimizer step that skips non-finite gradients.

* ``wrap_for_training`` puts every model chunk in megatron-core's ``DistributedDataParallel``
  (contiguous grad buffers, fp32 grad reduction, gradients averaged over data-parallel ranks) and
  registers megatron's ``finalize_model_grads`` with the schedule.
* ``build_optimizer`` makes ``get_megatron_optimizer`` (Adam with decoupled weight decay; the
  distributed optimizer shards its state over data-parallel ranks) and megatron's
  ``OptimizerParamScheduler``.
* ``guarded_step`` computes the global grad norm first and steps only when it is finite; a
  skipped step changes no parameter and no optimizer state.

``OptimizerSettings.megatron_overrides`` (verl's ``optim.override_optimizer_config``) are
OptimizerConfig fields applied last, e.g. megatron's CPU optimizer (``optimizer_cpu_offload``,
``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``, with
``use_precision_aware_optimizer``): the optimizer state and its update stay in host memory for
good. On a machine without CUDA the state is in host memory already and megatron-core 0.16.1's
hybrid optimizer cannot run there (its precision-aware path needs Transformer Engine), so those
fields are left out with a log line. (``megatron.optimizer_offload`` is something else: the
state moves to the host between phases, ``offload``.)
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
import torch.distributed as dist

from megarl.engine.settings import OptimizerSettings
from megarl.platform import has_cuda

logger = logging.getLogger(__name__)

# megatron's hybrid CPU optimizer: meaningful (and runnable) only with a device to offload from
CPU_OPTIMIZER_FIELDS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                        "use_precision_aware_optimizer", "use_torch_optimizer_for_cpu_offload", "pin_cpu_grads",
                        "pin_cpu_params")


def mark_tensor_parallel_weights(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Tag the weights of megatron's parallel layers as tensor-parallel, as megatron does when it
    initialises them.

    megatron-core 0.16.1 sets ``tensor_model_parallel`` / ``partition_dim`` on a Column/Row-parallel
    or vocab-parallel weight only inside its weight initialisation, which a model built to load a
    checkpoint skips (``perform_initialization=False``). Untagged, the weight counts as a
    duplicate on every TP rank but the first, so the global grad norm, and with it gradient
    clipping, would miss the other ranks' shards.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    split_dims = ((ColumnParallelLinear, 0), (RowParallelLinear, 1), (VocabParallelEmbedding, 0))
    for chunk in model_chunks:
        for module in chunk.modules():
            dim = next((d for kind, d in split_dims if isinstance(module, kind)), None)
            weight = getattr(module, "weight", None)
            if dim is None or weight is None or getattr(weight, "tensor_model_parallel", False):
                continue
            weight.tensor_model_parallel = True
            weight.partition_dim = dim
            weight.partition_stride = getattr(weight, "partition_stride", 1)


def wrap_for_training(model_chunks: Sequence[torch.nn.Module], use_distributed_optimizer: bool) -> list[torch.nn.Module]:
    """Wrap each model chunk in mcore DDP and hook gradient finalisation into the schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    mark_tensor_parallel_weights(model_chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = [
        # Megatron buckets only the first chunk; the others reduce as one bucket each.
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(model_chunks)
    ]
    config = get_model_config(wrapped[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def build_optimizer(ddp_chunks: Sequence[torch.nn.Module], settings: OptimizerSettings):
    """(megatron optimizer, OptimizerParamScheduler) for the DDP-wrapped chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.utils import get_model_config

    model_config = get_model_config(ddp_chunks[0])
    overrides = dict(settings.megatron_overrides)
    host_only = sorted(k for k in CPU_OPTIMIZER_FIELDS if k in overrides)
    if host_only and not has_cuda():
        logger.log(logging.INFO if dist.get_rank() == 0 else logging.DEBUG, "override_optimizer_config %s left out: "
                   "no CUDA here, the optimizer state is in host memory already", ", ".join(host_only))
        overrides = {k: v for k, v in overrides.items() if k not in CPU_OPTIMIZER_FIELDS}
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
        **overrides,
    )
    optimizer = get_megatron_optimizer(config, list(ddp_chunks))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=settings.lr_warmup_init,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=_decay_steps(settings),
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _decay_steps(settings: OptimizerSettings) -> int:
    if settings.total_training_steps <= 0:  # constant after warmup: the decay horizon is never reached
        return settings.lr_warmup_steps + 1
    if settings.lr_warmup_steps >= settings.total_training_steps:
        raise ValueError(
            f"lr warmup ({settings.lr_warmup_steps} steps) must be shorter than total_training_steps "
            f"({settings.total_training_steps}); lower optim.lr_warmup_steps or lr_warmup_steps_ratio"
        )
    return settings.total_training_steps


def initialize_optimizer_state(optimizer) -> None:
    """Create Adam's state (step 0, zero moments) where torch has not created it yet.

    Without apex / Transformer Engine, megatron's optimizer is torch's AdamW, which creates its
    state lazily at the first step; megatron's checkpoint code reads that state (and asserts on
    its step). A fresh optimizer that loads a checkpoint, or saves one before its first step,
    needs it to exist. Zero moments at step 0 are exactly what the first step would start from.
    """
    for inner in [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]:
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def guarded_step(optimizer) -> tuple[bool, float]:
    """Clip and apply the accumulated gradients unless their global norm is inf/NaN.

    Returns (stepped, grad_norm). The norm is the same on every rank (megatron reduces it over
    the model-parallel and, with the distributed optimizer, data-parallel ranks), so all ranks
    agree on skipping.
    """
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm):
        return False, grad_norm
    stepped, _, _ = optimizer.step()
    return bool(stepped), grad_norm
