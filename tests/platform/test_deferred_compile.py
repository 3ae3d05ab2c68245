"""megatron's ``jit_fuser`` kernels are compiled at their first call, not at import
(megarl/platform/deferred_compile.py): the same ``torch.compile``, later. The suite's conftest imports
megarl first, as every megarl process does, so the megatron this process imports went through the hook."""
import subprocess
import sys

import pytest
import torch

import megarl
from megarl.platform import deferred_compile


def test_megatrons_fuser_waits_for_the_first_call():
    import megatron.core.jit as jit
    from megatron.core import activations
    from megatron.core.transformer.attention import Attention

    assert jit.jit_fuser is deferred_compile.compile_on_first_call
    for kernel in (activations.squared_relu, Attention._apply_output_gate):
        assert getattr(kernel, "compiles_on_first_call", False), kernel


def test_the_compile_is_torch_compile_with_its_options_done_once_at_the_first_call(monkeypatch):
    compiles = []

    def fake_compile(function, **options):
        compiles.append(options)
        return lambda *args, **kwargs: ("compiled", function(*args, **kwargs))

    monkeypatch.setattr(torch, "compile", fake_compile)

    def double(x):
        return 2 * x

    def on(device):  # "meta" stands for an accelerator: any device but the CPU
        return torch.ones(2, device=device)

    plain = deferred_compile.compile_on_first_call(double)
    tuned = deferred_compile.compile_on_first_call(mode="max-autotune")(double)  # @jit_fuser(mode=...)
    assert compiles == [] and plain.__name__ == "double"
    first, second = plain(on("meta")), plain(x=on("meta"))
    assert first[0] == second[0] == "compiled" and first[1].device.type == "meta"
    assert tuned(on("meta"))[0] == "compiled"
    assert compiles == [{}, {"mode": "max-autotune"}]


def test_on_cpu_tensors_a_kernel_runs_uncompiled(monkeypatch):
    """On CPU inductor needs a C++ compiler and seconds per process for kernels that fuse nothing worth it."""
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled a kernel called on CPU tensors"))

    @deferred_compile.compile_on_first_call
    def gate(x, scale=2.0):
        return x * scale

    assert torch.equal(gate(torch.ones(3)), torch.full((3,), 2.0))
    assert torch.equal(gate(x=torch.ones(2), scale=3.0), torch.full((2,), 3.0))
    assert gate(1.5) == 3.0  # no tensor at all: as written


def test_megatrons_swiglu_runs_uncompiled_on_cpu_and_computes_swiglu(monkeypatch):
    """The MoE experts' GLU, as megatron decorated it, called on CPU tensors."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, swiglu

    assert getattr(swiglu, "compiles_on_first_call", False)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled a kernel called on CPU tensors"))
    x = torch.randn(4, 8)
    out = bias_swiglu_impl(x, None)
    a, b = x.chunk(2, dim=-1)
    assert torch.allclose(out, torch.nn.functional.silu(a) * b)


def test_a_fuser_megatron_did_not_set_to_torch_compile_is_left_alone():
    def noop(function):
        return function

    jit = type("Jit", (), {"jit_fuser": staticmethod(noop)})
    deferred_compile.on_jit_import(jit)
    assert jit.jit_fuser is noop


def test_the_hook_is_installed_once_and_finds_only_megatrons_jit():
    import megatron.core

    hooks = [finder for finder in sys.meta_path if isinstance(finder, megarl._AfterMegatronJit)]
    assert len(hooks) == 1
    assert hooks[0].find_spec("megatron.core.utils", megatron.core.__path__) is None
    assert hooks[0].find_spec("json", None) is None
    spec = hooks[0].find_spec("megatron.core.jit", megatron.core.__path__)
    assert spec is not None and spec.origin.endswith("megatron/core/jit.py")


@pytest.mark.heavy
def test_a_process_that_imports_megatron_after_megarl_loads_neither_dynamo_nor_inductor():
    code = ("import sys, megarl, megatron.core.models.gpt, megatron.core.transformer.moe.moe_layer; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
