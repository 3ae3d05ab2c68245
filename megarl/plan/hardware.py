"""The hardware a plan assumes: a small table of published GPU figures, and the efficiencies.

Every figure the planner uses is a field of ``Hardware`` (what the datasheet says) or
``Efficiency`` (how much of it megarl assumes a run gets); both are printed with every plan and
each can be overridden on the command line. Sources of the table (docs/planning.md):

* H100 SXM5 80GB, H200 SXM 141GB, A100 SXM4 80/40GB: NVIDIA's H100, H200 and A100 datasheets
  (memory, HBM bandwidth, dense BF16 Tensor Core TFLOP/s = half the "with sparsity" figure,
  NVLink bandwidth: the datasheets give both directions together, a GPU sends half of it);
* B200: NVIDIA's HGX B200 / DGX B200 datasheets (180 GB HBM3e, 8 TB/s, 36 PFLOP/s FP16/BF16 with
  sparsity per 8 GPUs, fifth-generation NVLink 1.8 TB/s);
* InfiniBand per GPU: the DGX systems' one compute NIC per GPU (DGX A100: ConnectX-6 200 Gb/s;
  DGX H100 / H200 / B200: ConnectX-7 400 Gb/s), line rate in GB/s.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """Published figures of one GPU model (per GPU; link figures per direction)."""

    name: str
    memory_gb: float  # device memory
    bf16_tflops: float  # dense BF16 Tensor Core peak
    hbm_gbps: float  # device memory bandwidth
    nvlink_gbps: float  # NVLink, one direction
    ib_gbps: float  # the GPU's own network interface (InfiniBand / RoCE), one direction

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB


GPUS: dict[str, Hardware] = {g.name: g for g in (
    Hardware("a100-40gb", 40, 312, 1555, 300, 25),
    Hardware("a100", 80, 312, 2039, 300, 25),
    Hardware("h100", 80, 989, 3350, 450, 50),
    Hardware("h200", 141, 989, 4800, 450, 50),
    Hardware("b200", 180, 2250, 8000, 900, 50),
)}

# Names the CUDA driver reports (torch.cuda.get_device_name), most specific first.
DEVICE_NAMES = (("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"), ("A100", "a100"),
                ("H100", "h100"), ("H200", "h200"), ("B200", "b200"))


@dataclass(frozen=True)
class Efficiency:
    """The fraction of each peak a run is assumed to reach, and the fixed costs megarl assumes.

    mfu: training FLOP/s over ``bf16_tflops`` (model FLOPs utilisation; recompute is counted as
        extra FLOPs, the pipeline bubble separately).
    decode_hbm: achieved over peak HBM bandwidth in vLLM's memory-bound decode steps.
    prefill_mfu: achieved over peak FLOP/s in vLLM's prefill (compute-bound).
    link: achieved over line rate for NVLink and the network (NCCL's large-message bandwidth).
    tp_latency_us: one tensor-parallel all-reduce of a decode step (two per layer), within a node;
        across nodes it is ``ib_latency_us``.
    cuda_context_gb: device memory every process holds outside PyTorch's allocator (CUDA context,
        cuBLAS/NCCL workspaces): once for the trainer rank, once for a colocated vLLM worker.
    """

    mfu: float = 0.35
    decode_hbm: float = 0.7
    prefill_mfu: float = 0.5
    link: float = 0.8
    tp_latency_us: float = 10.0
    ib_latency_us: float = 25.0
    cuda_context_gb: float = 1.0


def gpu(name: str) -> Hardware:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --memory-gb, --tflops, "
                         "--hbm-gbps, --nvlink-gbps and --ib-gbps)") from None


def with_overrides(hardware: Hardware, **figures: float | None) -> Hardware:
    """``hardware`` with the given figures replaced (None: keep)."""
    known = {f.name for f in fields(Hardware)} - {"name"}
    unknown = sorted(set(figures) - known)
    if unknown:
        raise ValueError(f"unknown hardware figure(s) {unknown}; known: {sorted(known)}")
    changed = {k: float(v) for k, v in figures.items() if v is not None}
    for key, value in changed.items():
        if value <= 0:
            raise ValueError(f"hardware figure {key}={value}: must be > 0")
    return replace(hardware, name=hardware.name + ("*" if changed else ""), **changed)


def efficiency_with(efficiency: Efficiency, **figures: float | None) -> Efficiency:
    changed = {k: float(v) for k, v in figures.items() if v is not None}
    for key, value in changed.items():
        if key not in {f.name for f in fields(Efficiency)}:
            raise ValueError(f"unknown efficiency figure {key!r}")
        if value < 0 or (key in ("mfu", "decode_hbm", "prefill_mfu", "link") and not 0 < value <= 1):
            raise ValueError(f"{key}={value}: a fraction must be in (0, 1], a cost >= 0")
    return replace(efficiency, **changed)


def local_gpu() -> Hardware | None:
    """The GPU of this machine as a table entry (its real memory size), or None without CUDA.

    An unknown model gets its memory from the driver and the H100's speeds (they only matter
    for times, never for whether a run fits).
    """
    from megarl.platform.hardware import gpu_identity

    identity = gpu_identity()
    if identity is None:
        return None
    name, memory = identity
    memory_gb = memory / GB
    entry = next((GPUS[key] for fragment, key in DEVICE_NAMES if fragment in name), GPUS["h100"])
    return replace(entry, name=name, memory_gb=memory_gb)


def figures(hardware: Hardware, efficiency: Efficiency) -> dict:
    return {"hardware": asdict(hardware), "efficiency": asdict(efficiency)}
