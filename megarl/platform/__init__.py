"""Platform layer: the one place in megarl that knows whether CUDA is there.

Device facts (``device()``, ``dist_backend()``, ``default_dtype()``, ...), process-group setup
(``init_distributed``, ``initialize_model_parallel``, ``destroy``) and the CPU compatibility layer
that lets megatron-core run on a machine without CUDA (``ensure_platform``, ``apply_cpu_compat``).
"""

from megarl.platform.cpu_compat import (
    REDIRECTS,
    Redirect,
    applied_redirects,
    apply_cpu_compat,
    ensure_platform,
    redirect_names,
)
from megarl.platform.hardware import (
    cuda_profiler,
    default_dtype,
    device,
    device_rng_state,
    dist_backend,
    empty_cache,
    gpu_identity,
    has_cuda,
    host_buffer,
    local_rank,
    memory_stats,
    nvtx_range,
    set_device,
    set_device_rng_state,
    synchronize,
)
from megarl.platform.distributed import (collective_device, destroy, destroy_model_parallel, init_distributed,
                                         initialize_model_parallel, model_parallel_seed)
from megarl.platform.mcore_config import cpu_transformer_config_overrides, transformer_config_overrides

__all__ = [
    "collective_device",
    "REDIRECTS",
    "Redirect",
    "applied_redirects",
    "apply_cpu_compat",
    "cpu_transformer_config_overrides",
    "cuda_profiler",
    "default_dtype",
    "destroy",
    "destroy_model_parallel",
    "device",
    "device_rng_state",
    "dist_backend",
    "empty_cache",
    "ensure_platform",
    "gpu_identity",
    "has_cuda",
    "host_buffer",
    "init_distributed",
    "initialize_model_parallel",
    "local_rank",
    "memory_stats",
    "nvtx_range",
    "model_parallel_seed",
    "redirect_names",
    "set_device",
    "set_device_rng_state",
    "synchronize",
    "transformer_config_overrides",
]
