"""Process groups: torch.distributed from torchrun's environment, then megatron-core's parallel state.

``init_distributed`` picks the backend for the machine (NCCL on GPU, gloo on CPU) and applies the
CPU compatibility layer first, so megatron-core works on either. ``initialize_model_parallel``
is a thin wrapper over megatron's, followed by the seeding megatron's training loop does.
``destroy`` undoes both. Both take the collectives' timeout (verl's ``actor_rollout_ref.nccl_timeout``,
in seconds, for NCCL and gloo alike): a rank that waits longer in a collective fails instead of
hanging the job.

The rendezvous store of a multi-process world is hosted by rank 0 and listens on MASTER_ADDR's
address only (``megarl.platform.network``; torch's ``env://`` would listen on every interface), and
gloo's and NCCL's own sockets are pinned to the interface towards MASTER_ADDR. Under torchrun's
agent store (``TORCHELASTIC_USE_AGENT_STORE``) the agent hosts the store and every rank connects.
"""

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megarl.platform import cpu_compat, hardware, network

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


DEFAULT_TIMEOUT_S = 1800


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise torch.distributed from torchrun's variables; a no-op if it is already initialised.

    With none of RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, this is a single process
    (world size 1, an in-memory store: no port is opened). The CPU compatibility layer is applied
    first on a machine without CUDA. ``timeout_s`` bounds every collective of the default group.
    """
    present = [name for name in _TORCHRUN_VARIABLES if name in os.environ]
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if present and missing:
        raise RuntimeError(
            f"torch.distributed environment is incomplete: {', '.join(missing)} unset while {', '.join(present)} "
            f"set; launch with torchrun, or set all of {', '.join(_TORCHRUN_VARIABLES)}"
        )
    cpu_compat.ensure_platform()
    if dist.is_initialized():
        return
    if timeout_s <= 0:
        raise ValueError(f"a collective timeout must be > 0 seconds, got {timeout_s} (actor_rollout_ref.nccl_timeout)")
    timeout = timedelta(seconds=timeout_s)
    if not present:
        hardware.set_device(0)
        dist.init_process_group(hardware.dist_backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    hardware.set_device()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    network.pin_socket_interfaces(master_addr)
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = network.tcp_store(master_addr, master_port, world_size, hosts_store, timeout_s, wait_for_workers=False)
    dist.init_process_group(hardware.dist_backend(), store=store, rank=rank, world_size=world_size, timeout=timeout)


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    etp: int | None = None,
    seed: int = 1234,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Create megatron-core's TP/PP/EP/CP/DP groups, then seed all RNGs for model parallelism.

    ``vpp`` is the number of virtual pipeline stages per rank (None: no interleaving); ``etp`` is
    the expert tensor-parallel size (None: same as ``tp``). Data parallelism takes the rest of the
    world. ``timeout_s`` bounds the collectives of every group megatron creates.
    """
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call megarl.platform.init_distributed() first")
    for name, size in {"tp": tp, "pp": pp, "ep": ep, "cp": cp}.items():
        if size < 1:
            raise ValueError(f"{name}={size}: parallel sizes must be >= 1")
    world_size = dist.get_world_size()
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
            "change the sizes or the number of processes"
        )
    if vpp is not None and pp < 2:
        raise ValueError(f"vpp={vpp} needs pipeline parallelism (pp >= 2), got pp={pp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_s / 60,
    )
    model_parallel_seed(seed)


def model_parallel_seed(seed: int) -> None:
    """Seed Python, NumPy and torch, then megatron's RNG tracker (per-TP-rank and per-EP-rank states).

    Every rank gets the same default generator seed, so ``use_cpu_initialization`` builds the same
    full (master) weights everywhere and each TP rank keeps its slice.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def collective_device(group=None) -> torch.device:
    """Where ``group``'s backend reduces: the current GPU for NCCL, the host for gloo. A host tensor (a count,
    a metric, a routing table) goes there for a collective and comes back: NCCL takes device tensors only."""
    return hardware.device() if dist.get_backend(group) == "nccl" else torch.device("cpu")


def destroy_model_parallel() -> None:
    """Tear down megatron's parallel state and destroy the process groups it made; the default group stays.

    megatron's own ``destroy_model_parallel`` forgets its groups but leaves them open, each with its gloo
    connections and threads. A process that sets up model parallelism again and again (a test worker going
    through layouts; one set-up makes about 20 groups) then slows down with every round: the model tests'
    69 layouts took 250 s that way and 21 s with the groups destroyed.
    """
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    default = distributed_c10d._get_default_group()
    for group in list(distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)


def destroy() -> None:
    """Tear down megatron's parallel state, its process groups and the default group (each only if present)."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
