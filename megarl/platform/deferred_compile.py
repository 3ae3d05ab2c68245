"""Megatron-core's ``jit_fuser`` kernels are compiled on their first call, not when megatron is imported.

``megatron.core.jit`` binds ``jit_fuser = torch.compile``, and a dozen megatron modules decorate
small kernels with it as they are imported: activations, the MoE router's expert bias, the gated
attention's output gate (Qwen3-Next), the MoE experts' GLU, the L2 norm, the fused
bias-activation functions. ``torch.compile`` compiles lazily anyway, on a function's first call,
but the decoration itself imports dynamo and inductor: 1.6 CPU-seconds in every process that
imports megatron (a trainer worker, a torchrun rank, a conversion, a planner), whether or not one
of those kernels ever runs. Most never do: a dense model with megarl's CPU flags (``mcore_config``)
calls none of them.

So, the moment ``megatron.core.jit`` is imported and before any kernel is decorated (the hook in
``megarl/__init__.py``), its ``jit_fuser`` becomes ``compile_on_first_call``: the same
``torch.compile`` with the same arguments, applied when the kernel is first called on an accelerator's
tensors. On a GPU the fused kernels are built at the first step instead of at import, which changes
nothing but when the import cost is paid.

Called on CPU tensors, a kernel runs as written, uncompiled. A fused kernel exists to save a GPU's
memory traffic and kernel launches; on CPU, where megarl runs its tiny test and development models,
inductor gains nothing measurable and costs a great deal: it needs a C++ compiler at run time, builds
each kernel in about 20 s on a machine's first use (2 cores), and then spends 3-4 CPU-s in every
process that calls one (tracing, cache lookups): measured, a Qwen3-Next GRPO test 26-27 s instead of
31-36. The math is the kernel's own Python, which torch.compile only fuses.
"""
import functools
import itertools

import torch


def compile_on_first_call(function=None, **options):
    """``torch.compile(function, **options)``, done at ``function``'s first call on an accelerator's tensors
    (on CPU tensors ``function`` runs uncompiled); usable as ``@jit_fuser`` and as ``@jit_fuser(**options)``."""
    if function is None:
        return functools.partial(compile_on_first_call, **options)
    compiled = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        nonlocal compiled
        if not on_accelerator(args, kwargs):
            return function(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(function, **options)
        return compiled(*args, **kwargs)

    call.compiles_on_first_call = True
    return call


def on_accelerator(args, kwargs) -> bool:
    """Whether a kernel's call is on an accelerator: its first tensor argument is on a device other than the CPU."""
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type != "cpu"
    return False


def on_jit_import(jit_module) -> None:
    """Called with ``megatron.core.jit`` right after it is imported: where megatron chose
    ``torch.compile`` as its fuser, the compile waits for each kernel's first call."""
    if jit_module.jit_fuser is torch.compile:
        jit_module.jit_fuser = compile_on_first_call
