"""The adapter on one megatron-core parallel linear: its forward under TP / SP / expert parallelism,
the switch that turns it off, and its checkpoint sharding.

An adapted linear keeps its class, module and parameter names: ``attach`` swaps its class for a
subclass with ``LoRALinear`` mixed in (as torch's FSDP2 does with ``fully_shard``) and adds the
parameters ``lora_A`` ``[rank, in_local]`` and ``lora_B`` ``[out_local, rank]``, so
``y = base(x) + scale * B @ A @ dropout(x)``. The base weight is untouched (and frozen by the
transform), so the bridge's loading, export and shard layout see the same model.

Communication, per kind of base layer (``h = A x`` is ``rank`` wide, so the adapter only ever
communicates rank-wide activations, never an extra copy of ``x``):

* column-parallel (output split over TP; A whole, B split like the weight): without SP ``x`` is
  whole on every TP rank and ``h`` goes through megatron's copy-to-TP region (identity forward,
  all-reduce of ``dh`` backward, so A's gradient is whole and equal on every rank); with SP ``x``
  is this rank's sequence slice, ``h`` is all-gathered over the sequence (reduce-scattered back),
  and A's gradient, a sum over sequence slices, is all-reduced over TP by megatron's
  ``finalize_model_grads`` (A is tagged ``sequence_parallel``, like the layer norms);
* row-parallel (input split; A split like the weight, B whole): ``h`` is a partial sum over TP,
  reduced before B exactly where the base layer reduces its output: all-reduced without SP,
  reduce-scattered over the sequence with SP (then B's gradient is all-reduced over TP by
  ``finalize_model_grads``: B is tagged ``sequence_parallel``);
* expert linears (megatron's token dispatcher does their TP communication) and replicated
  linears: no communication; expert-TP must be 1 (checked by the transform).

Dropout (``pre``: on the adapter's input) uses the default generator where ``x`` is the same on
every TP rank (so every rank drops the same elements) and megatron's model-parallel RNG tracker
where it is not (SP slices, row-parallel inputs), as megatron's own dropouts do.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

COLUMN, ROW, REPLICATED = "column", "row", "replicated"


@dataclass(frozen=True)
class Placement:
    """How the adapter of one linear communicates (see the module docstring)."""

    parallel: str  # column | row | replicated
    tp_size: int  # 1 also for expert linears (their dispatcher communicates) and replicated ones
    sequence_parallel: bool
    gather_output: bool  # a column-parallel linear that gathers its output (megatron's gather_output)
    layernorm_fused: bool  # Transformer Engine's LayerNormColumnParallelLinear: the adapter reads the norm's output
    group: object = None  # the TP process group (expert-TP for experts)


def placement_of(module: torch.nn.Module) -> Placement:
    """The adapter placement for a megatron-core (local or Transformer Engine) parallel linear."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    name = type(module).__name__
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        parallel = COLUMN if isinstance(module, ColumnParallelLinear) else ROW
        if parallel == ROW and not module.input_is_parallel:
            raise ValueError(f"{name} with input_is_parallel=False: LoRA adapts row-parallel linears of split inputs only")
        size = module.tp_group.size() if module.tp_group is not None else 1
        if module.explicit_expert_comm:
            return Placement(parallel, 1, False, False, False)
        return Placement(parallel, size, bool(module.sequence_parallel) and size > 1,
                         parallel == COLUMN and bool(module.gather_output), False, module.tp_group)
    mode = getattr(module, "parallel_mode", "missing")
    if name in ("TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear") \
            and mode != "missing":
        fused = name == "TELayerNormColumnParallelLinear"
        if mode in ("column", "row"):
            size = int(module.tp_size)
            return Placement(COLUMN if mode == "column" else ROW, size, bool(module.sequence_parallel) and size > 1,
                             False, fused, module.tp_group)
        return Placement(REPLICATED if mode == "duplicated" or name == "TELinear" else
                         (COLUMN if "Column" in name else ROW), 1, False, False, fused)
    raise ValueError(f"LoRA does not know how to adapt a {name}; megarl adapts megatron-core's Column/Row parallel "
                     "linears and Transformer Engine's")


class LoRALinear:
    """Mixed into an adapted linear's class (see ``attach``); the base class follows in the MRO."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter
    lora_B_mask: torch.Tensor | None
    lora_scale: float
    lora_dropout: float
    lora_enabled: bool
    lora_placement: Placement

    def forward(self, input_, *args, **kwargs):
        if kwargs.get("weight") is not None:
            raise RuntimeError(f"{type(self).__name__}: a LoRA-adapted linear cannot take its weight as an argument")
        out = super().forward(input_, *args, **kwargs)
        adapter_input = input_
        if self.lora_placement.layernorm_fused:  # TE returns (out, ln_out) or (out, bias, ln_out)
            (output, adapter_input), bias = out if len(out) == 2 and isinstance(out[0], tuple) else \
                ((out[0], out[2]), out[1])
        else:
            output, bias = out
        if not self.lora_enabled:
            return output, bias
        return output + self.lora_delta(adapter_input), bias

    def lora_B_effective(self) -> torch.Tensor:
        """B with what does not train held at zero: the rows of projections that are not adapted, and
        under canonical_lora each projection's columns of the other projections' A."""
        return self.lora_B if self.lora_B_mask is None else self.lora_B * self.lora_B_mask

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A dropout(x)``, laid out like the base layer's output."""
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel import mappings

        p = self.lora_placement
        if self.training and self.lora_dropout > 0:
            if p.tp_size > 1 and (p.sequence_parallel or p.parallel == ROW):
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    x = F.dropout(x, self.lora_dropout)
            else:
                x = F.dropout(x, self.lora_dropout)
        h = F.linear(x, self.lora_A)
        if p.parallel == COLUMN and p.tp_size > 1:
            if p.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, True, group=p.group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=p.group)
        elif p.parallel == ROW and p.tp_size > 1:
            if p.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=p.group)
            else:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=p.group)
        y = F.linear(h, self.lora_B_effective()) * self.lora_scale
        if p.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y, group=p.group)
        return y

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base layer's sharded tensors, with the adapters split along their TP dimension."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        p = self.lora_placement
        axis = {COLUMN: {"lora_B": 0}, ROW: {"lora_A": 1}}.get(p.parallel, {})
        groups = {}
        if metadata and "dp_cp_group" in metadata:
            groups = {"tp_group": self.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
        adapters = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        sharded = make_sharded_tensors_for_checkpoint(adapters, prefix, axis, sharded_offsets, **groups)
        if getattr(self, "lora_swiglu", False):  # [gate; up] rows: stored as two tensors, as megatron stores fc1
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        state.update(sharded)
        return state

    def extra_repr(self) -> str:
        base = super().extra_repr()
        rank = self.lora_A.shape[0]
        return f"{base}, lora_rank={rank}, lora_scale={self.lora_scale:g}" if base else \
            f"lora_rank={rank}, lora_scale={self.lora_scale:g}"


_CLASSES: dict[type, type] = {}


def lora_class(base: type) -> type:
    """``LoRA<Base>``: ``base`` with ``LoRALinear`` mixed in (one class per base class)."""
    if issubclass(base, LoRALinear):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (LoRALinear, base), {"__module__": __name__})
    return _CLASSES[base]


def attach(module: torch.nn.Module, placement: Placement, a: torch.Tensor, b: torch.Tensor,
           b_mask: torch.Tensor | None, scale: float, dropout: float, expert_split: bool = False) -> None:
    """Make ``module`` an adapted linear with the initial adapter values ``a`` and ``b``.

    The parameters carry megatron's attributes: the split one is ``tensor_model_parallel`` (its
    grad-norm share counts on every TP rank), ``allreduce`` follows the base weight (experts are
    reduced over expert-data-parallel ranks), and the one whose gradient is a sum over sequence
    slices is ``sequence_parallel`` (all-reduced over TP in ``finalize_model_grads``).
    """
    from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

    module.__class__ = lora_class(type(module))
    module.lora_A = torch.nn.Parameter(a)
    module.lora_B = torch.nn.Parameter(b)
    module.register_buffer("lora_B_mask", b_mask, persistent=False)
    module.lora_scale, module.lora_dropout, module.lora_enabled = float(scale), float(dropout), True
    module.lora_placement = placement
    split = {COLUMN: module.lora_B, ROW: module.lora_A}.get(placement.parallel)
    if split is not None and (placement.tp_size > 1 or expert_split):
        split.tensor_model_parallel = True
        split.partition_dim = 0 if split is module.lora_B else 1
        split.partition_stride = 1
    for param in (module.lora_A, module.lora_B):
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        param.allreduce = getattr(module.weight, "allreduce", True)
    if placement.sequence_parallel:
        (module.lora_A if placement.parallel == COLUMN else module.lora_B).sequence_parallel = True


def adapted_linears(model: torch.nn.Module):
    """(name, module) of every adapted linear of a model chunk (DDP wrappers included)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextmanager
def adapters_disabled(models):
    """Run ``models`` (model chunks) as their base model: every adapter path is skipped meanwhile."""
    modules = [m for model in models for _, m in adapted_linears(model)]
    previous = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, enabled in zip(modules, previous):
            m.lora_enabled = enabled
