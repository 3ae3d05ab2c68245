"""Platform layer: the one place in megarl that knows whether CUDA is there.

Device facts (``device()``, ``dist_backend()``, ``default_dtype()``, ...), process-group setup
(``init_distributed``, ``initialize_model_parallel``, ``destroy``) and the CPU compatibility layer
that lets megatron-core run on a machine without CUDA (``ensure_platform``, ``apply_cpu_compat``).
"""

import importlib

# Each public name and the module that holds it. Imported on first use (PEP 562), so that a process
# needing only a torch-free helper (``megarl.platform.processes``, ``.network``: the run reaper, the
# launch checks) does not pay torch's import (1.2 CPU-seconds).
_HOMES = {
    "cpu_compat": ["REDIRECTS", "Redirect", "applied_redirects", "apply_cpu_compat", "ensure_platform",
                   "redirect_names"],
    "hardware": ["cuda_profiler", "default_dtype", "device", "device_rng_state", "dist_backend", "empty_cache",
                 "gpu_identity", "has_cuda", "host_buffer", "local_rank", "memory_stats", "nvtx_range",
                 "set_device", "set_device_rng_state", "synchronize"],
    "distributed": ["collective_device", "destroy", "destroy_model_parallel", "init_distributed",
                    "initialize_model_parallel", "model_parallel_seed"],
    "mcore_config": ["cpu_transformer_config_overrides", "transformer_config_overrides"],
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str):
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup finds it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME_OF))


__all__ = sorted(_HOME_OF)
