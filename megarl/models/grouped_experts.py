"""Grouped-GEMM experts (``moe_grouped_gemm=True``): the module megatron builds, its weights under the bridge's names.

The bridge names expert weights as megatron's ``SequentialMLP`` holds them, one linear pair per local expert
``i``: ``mlp.experts.local_experts.<i>.linear_fc1.weight`` [fc1 / etp, hidden] (SwiGLU: this rank's gate rows,
then its up rows) and ``linear_fc2.weight`` [hidden, ffn / etp]. The shard layout, the loader, the export, the
weight sync and the conversion tools all use those names. megatron-core's grouped modules hold the same
numbers differently:

* ``TEGroupedMLP`` (Transformer Engine's layer spec, on GPU): one parameter per local expert,
  ``mlp.experts.linear_fc1.weight<i>`` / ``linear_fc2.weight<i>``, shaped as SequentialMLP's (TE's
  ``GroupedLinear`` keeps ``nn.Linear``'s [out, in]): only the names differ.
* ``GroupedMLP`` (megatron's "legacy" module: the local layer spec's, and the CPU path over the stand-in of
  the ``grouped_gemm`` package, ``megarl.platform.cpu_compat``): two parameters for all local experts,
  ``mlp.experts.weight1`` [hidden, E * fc1] that megatron views as [E, hidden, fc1], and ``weight2``
  [E * ffn, hidden] viewed as [E, ffn, hidden]: each expert's weight transposed, the experts one after the
  other in memory. Its fc1 per expert is SequentialMLP's ([gate; up] of the rank's slice; megatron's GLU
  takes the two halves of fc1's output), as its distributed checkpoint says (``GroupedMLP.sharded_state_dict``
  stores the experts under SequentialMLP's keys).

``bridge_tensors`` gives every parameter of a model chunk under the bridge's names: a grouped expert's weight
is a view (no copy), so the loader writes through it and the export and the weight sync read the trained
values. ``grouped_gemm_problem`` says before the build why grouped experts cannot run here, or None.
"""
from __future__ import annotations

import re

import torch

_TE_EXPERT = re.compile(r"^(?P<experts>.*\.experts\.)(?P<linear>linear_fc[12])\.(?P<kind>weight|bias)(?P<index>\d+)$")
_GROUPED = re.compile(r"^(?P<experts>.*\.experts\.)weight(?P<which>[12])$")


def te_expert_name(name: str) -> str:
    """The bridge's name of a ``TEGroupedMLP`` parameter (``...experts.linear_fc1.weight3`` ->
    ``...experts.local_experts.3.linear_fc1.weight``); any other name unchanged."""
    match = _TE_EXPERT.match(name)
    if match is None:
        return name
    return f"{match['experts']}local_experts.{match['index']}.{match['linear']}.{match['kind']}"


def grouped_expert_views(experts_prefix: str, which: int, weight: torch.Tensor, num_experts: int,
                         hidden: int) -> dict[str, torch.Tensor]:
    """``GroupedMLP``'s ``weight1`` (``which=1``) or ``weight2`` as one view per local expert, named and shaped
    as SequentialMLP's ``local_experts.<i>.linear_fc1.weight`` [fc1, hidden] / ``linear_fc2.weight`` [hidden, ffn]."""
    if which == 1:
        per_expert, linear = weight.detach().view(num_experts, hidden, -1), "linear_fc1"
    else:
        per_expert, linear = weight.detach().view(num_experts, -1, hidden), "linear_fc2"
    return {f"{experts_prefix}local_experts.{i}.{linear}.weight": per_expert[i].t() for i in range(num_experts)}


def bridge_tensors(module: torch.nn.Module, of=lambda param: param) -> dict[str, torch.Tensor]:
    """name -> tensor of every parameter of a model chunk, grouped experts under SequentialMLP's names.

    ``of`` picks the tensor of a parameter: the parameter itself, or for example its ``.grad``.
    """
    tensors = {}
    for name, param in module.named_parameters():
        grouped = _GROUPED.match(name)
        if grouped is not None:
            experts = module.get_submodule(name.rsplit(".", 1)[0])
            tensors.update(grouped_expert_views(grouped["experts"], int(grouped["which"]), of(param),
                                                experts.num_local_experts, experts.config.hidden_size))
        else:
            tensors[te_expert_name(name)] = of(param)
    return tensors


def has_grouped_experts(module: torch.nn.Module) -> bool:
    """Whether a model chunk's experts are grouped (``GroupedMLP`` or ``TEGroupedMLP``): no per-expert linears."""
    return any(_GROUPED.match(name) or _TE_EXPERT.match(name) for name, _ in module.named_parameters())


def grouped_gemm_problem(family, uses_te_spec: bool, has_cuda: bool) -> str | None:
    """Why ``moe_grouped_gemm=True`` cannot build this family's experts here, or None.

    ``uses_te_spec``: the experts come from megatron's Transformer Engine spec (TEGroupedMLP); else from the
    local spec (GroupedMLP), which needs the ``grouped_gemm`` package on a GPU and its stand-in on CPU.
    """
    if family.grouped_gemm_refusal is not None:
        return f"moe_grouped_gemm=True: {family.grouped_gemm_refusal}; leave moe_grouped_gemm unset (SequentialMLP)"
    if has_cuda and not uses_te_spec:
        from megatron.core.transformer.moe import grouped_gemm_util

        if not grouped_gemm_util.grouped_gemm_is_available():
            return ("moe_grouped_gemm=True on a GPU needs Transformer Engine (TEGroupedMLP) or, for megatron's "
                    "legacy GroupedMLP, the grouped_gemm package (pip install "
                    "git+https://github.com/fanshiqing/grouped_gemm@v1.1.4); neither imports here: install one, "
                    "or leave moe_grouped_gemm unset (SequentialMLP)")
    return None
