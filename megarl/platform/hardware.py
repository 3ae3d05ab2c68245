"""Device facts (hardware): the one place in megarl that asks whether CUDA is there.

Everything else in megarl calls these helpers instead of touching ``torch.cuda``, so the same
code runs on a GPU cluster (NCCL, bf16) and on a CPU-only machine (gloo, fp32).
"""

import os
import resource

import torch


def has_cuda() -> bool:
    """True when this process can use a CUDA device."""
    return torch.cuda.is_available()


def device_count() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if has_cuda() else 0


def local_rank() -> int:
    """This process's rank on its node, from torchrun's ``LOCAL_RANK`` (0 when unset)."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"LOCAL_RANK={value!r} is not an integer; unset it or set it to this process's rank on the node"
        ) from None


def device() -> torch.device:
    """The device this process computes on: ``cuda:<local_rank>`` with CUDA, else ``cpu``."""
    if has_cuda():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def set_device(rank_on_node: int | None = None) -> torch.device:
    """Bind this process to its GPU (``rank_on_node`` defaults to ``LOCAL_RANK``); a no-op on CPU."""
    if not has_cuda():
        return torch.device("cpu")
    index = local_rank() if rank_on_node is None else rank_on_node
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"local rank {index} has no GPU: this node has {count}; start at most {count} processes per node"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def dist_backend() -> str:
    """The torch.distributed backend: ``nccl`` on GPU, ``gloo`` on CPU."""
    return "nccl" if has_cuda() else "gloo"


def default_dtype() -> torch.dtype:
    """Compute dtype for model weights: bf16 on GPU; fp32 on CPU, where bf16 is 2-3x slower."""
    return torch.bfloat16 if has_cuda() else torch.float32


def synchronize() -> None:
    """Wait for queued device work (CUDA kernels); CPU work is already synchronous."""
    if has_cuda():
        torch.cuda.synchronize()


def empty_cache() -> None:
    """Return cached device memory to the driver; nothing to return on CPU."""
    if has_cuda():
        torch.cuda.empty_cache()


def memory_stats() -> dict[str, int]:
    """Memory in bytes with the same keys on both platforms.

    GPU: the caching allocator's allocated / reserved / peak-allocated bytes.
    CPU: the process's resident set size for ``allocated`` and ``reserved``, its peak for ``max_allocated``.
    """
    if has_cuda():
        return {
            "allocated_bytes": torch.cuda.memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(),
            "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        }
    with open("/proc/self/statm") as f:
        rss_bytes = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # Linux reports the peak in KiB, and updates it lazily: it can trail the current size.
    peak_bytes = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_bytes)
    return {"allocated_bytes": rss_bytes, "reserved_bytes": rss_bytes, "max_allocated_bytes": peak_bytes}


def host_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory as a uint8 tensor, for copies of device memory: page-locked with CUDA
    (asynchronous device<->host copies at full bandwidth), ordinary memory on CPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=has_cuda())


def limit_memory_fraction(fraction: float, device: torch.device) -> None:
    """This process may allocate at most ``fraction`` of ``device``'s memory (CUDA); nothing on CPU."""
    if has_cuda():
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def device_rng_state() -> torch.Tensor | None:
    """The accelerator's RNG state (for checkpoints); None on CPU, where torch's default generator is all."""
    return torch.cuda.get_rng_state() if has_cuda() else None


def set_device_rng_state(state: torch.Tensor | None) -> None:
    """Restore ``device_rng_state()``'s result; a no-op on CPU or for a state saved on CPU."""
    if has_cuda() and state is not None:
        torch.cuda.set_rng_state(state)


def gpu_identity() -> tuple[str, int] | None:
    """This machine's first GPU as (model name, memory in bytes), or None without CUDA."""
    if not has_cuda():
        return None
    return torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory


def nvtx_range(label: str):
    """A context manager naming a range for Nsight Systems (``torch.cuda.nvtx.range``)."""
    return torch.cuda.nvtx.range(label)


def cuda_profiler(start: bool) -> None:
    """Start or stop the CUDA profiler's capture (nsys with ``capture-range=cudaProfilerApi`` records between)."""
    if start:
        torch.cuda.profiler.start()
    else:
        torch.cuda.profiler.stop()
