"""megarl: reinforcement-learning post-training of large language models on megatron-core.

Importing megarl installs one import hook and nothing else (no torch): when ``megatron.core.jit``
is imported, ``megarl.platform.deferred_compile.on_jit_import`` runs right after it, before any of
megatron's kernels is decorated with its ``jit_fuser``. That module says why (it saves 1.6
CPU-seconds in every process that imports megatron). The hook sits here
because it must be in place before anything imports megatron, and every megarl process imports
this package first.
"""
import importlib.abc
import sys


class _AfterMegatronJit(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the other finders would, and runs megarl's hook after its code."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run_module = spec.loader.exec_module  # this spec's own loader (one per module found)

                def run_then_hook(module):
                    run_module(module)
                    from megarl.platform.deferred_compile import on_jit_import

                    on_jit_import(module)

                spec.loader.exec_module = run_then_hook
                return spec
        return None


if not any(isinstance(finder, _AfterMegatronJit) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterMegatronJit())
