"""A group of Ray actors that together form one torch.distributed world (the Megatron ranks).

    group = WorkerGroup(MegatronWorker, world_size=4, init_args=(cfg,))
    log_probs = group.call("compute_log_probs", batch_ref)[0]

Rank 0 reports its node's address and a port it holds listening there (``platform.network``: the
rendezvous store never listens on every interface); every actor then gets torchrun's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and initialises
torch.distributed through ``megarl.platform`` (NCCL on GPU, gloo on CPU; ``dist_timeout_s``
bounds its collectives, verl's ``actor_rollout_ref.nccl_timeout``), so code written for
torchrun runs unchanged inside Ray. Actors are placed into a placement group's bundles, one
rank per bundle (``megarl.cluster.placement``). While the driver waits for the ranks it watches
their processes (``process_watch``): a rank that dies is named within seconds.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from megarl.cluster.process_watch import ProcessWatch


class DistributedWorker:
    """Base class of a rank. Subclasses set up their engines in ``setup``.

    ``log_name`` names the rank's log file when the run collects worker output
    (``megarl.logging.worker_logs``): ``<run>/logs/trainer_rank0.log``.
    """

    def __init__(self, rank: int, world_size: int, env: dict[str, str] | None = None, log_name: str | None = None):
        from megarl.logging.worker_logs import capture_worker_output

        from megarl.platform.forks import kill_forks_with_parent

        capture_worker_output(log_name or f"rank{rank}")
        kill_forks_with_parent()  # megatron's checkpoint writers (forks) must not outlive the rank
        self.rank, self.world_size = rank, world_size
        for key, value in (env or {}).items():
            os.environ[key] = str(value)
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    def process_identity(self):
        from megarl.cluster.process_watch import this_process

        return this_process()

    def address_and_port(self) -> tuple[str, int]:
        """This node's cluster address and a port held listening on it (only there) for the store this
        process hosts next: the torch.distributed rendezvous, or the weight-sync store."""
        import ray

        from megarl.platform.network import reserve_port

        address = ray.util.get_node_ip_address()
        return address, reserve_port(address)

    def init_distributed(self, master_addr: str, master_port: int, local_rank: int, timeout_s: float) -> None:
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from megarl.platform import init_distributed

        init_distributed(timeout_s=timeout_s)

    def setup(self, *args, **kwargs) -> None:
        """Build engines; called on every rank after torch.distributed is up."""


class WorkerGroup:
    """``world_size`` ranks of ``worker_cls`` as Ray actors, with torch.distributed set up between them.

    ``slots`` (one ``placement.ActorSlot`` per rank, from ``ClusterPlacement.trainer_slots()``)
    puts rank ``r`` into its placement-group bundle with that bundle's share of CPU and GPU;
    without slots every rank asks Ray for ``num_cpus_per_worker`` / ``num_gpus_per_worker``.
    ``runtime_env(rank)``, when given, is rank ``rank``'s Ray runtime environment (or None): nsys
    profiling runs the ranks it selects under Ray's ``nsight`` plugin.
    """

    def __init__(self, worker_cls: type, world_size: int, *, init_args: Sequence[Any] = (),
                 init_kwargs: dict | None = None, num_cpus_per_worker: float = 1, num_gpus_per_worker: float = 0,
                 slots: Sequence[Any] | None = None, env: dict[str, str] | None = None, name: str = "trainer",
                 dist_timeout_s: float = 600, runtime_env: Callable[[int], dict | None] | None = None):
        import ray

        if world_size < 1:
            raise ValueError(f"a worker group needs world_size >= 1, got {world_size}")
        if slots is not None and len(slots) != world_size:
            raise ValueError(f"{len(slots)} placement slots for {world_size} ranks: give one slot per rank")
        remote_cls = ray.remote(worker_cls)
        self.world_size, self.name = world_size, name
        self._actors = []
        for rank in range(world_size):
            options: dict[str, Any] = (slots[rank].options() if slots is not None else
                                       dict(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker))
            if runtime_env is not None and (env_of_rank := runtime_env(rank)) is not None:
                options["runtime_env"] = env_of_rank
            self._actors.append(remote_cls.options(**options, max_concurrency=2).remote(rank, world_size, env,
                                                                                        f"{name}_rank{rank}"))
        self._watch = None
        try:
            self._watch = ProcessWatch(ray.get([a.process_identity.remote() for a in self._actors]), name)
            master_addr, master_port = self.wait([self._actors[0].address_and_port.remote()], "start-up", ranks=[0])[0]
            self.wait([a.init_distributed.remote(master_addr, master_port, self._local_rank(rank), dist_timeout_s)
                       for rank, a in enumerate(self._actors)], "torch.distributed start-up")
            self.call("setup", *init_args, **(init_kwargs or {}))
        except BaseException:
            self.shutdown()
            raise

    def _local_rank(self, rank: int) -> int:
        # One rank per bundle and bundles packed per node in order: on GPU nodes Ray sets
        # CUDA_VISIBLE_DEVICES per actor, so the local device index is always 0.
        return 0

    def wait(self, refs: list, what: str, timeout_s: float | None = None, ranks: Sequence[int] | None = None) -> list:
        """``ray.get(refs)`` while watching the ranks' processes: a dead rank raises ``WorkerDied`` naming it
        within seconds, a wait longer than ``timeout_s`` raises ``TimeoutError`` (``process_watch``)."""
        return self._watch.wait(refs, what, timeout_s, ranks)

    def call(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` on every rank with the same arguments; wait; return results by rank."""
        return self.wait([getattr(a, method).remote(*args, **kwargs) for a in self._actors], method)

    def call_async(self, method: str, *args, **kwargs) -> list:
        """Start ``method`` on every rank; the Ray refs, by rank (for waiting together with other work)."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self._actors]

    def call_rank(self, rank: int, method: str, *args, **kwargs) -> Any:
        """Call ``method`` on one rank and wait for its result."""
        return self.wait([getattr(self._actors[rank], method).remote(*args, **kwargs)], method, ranks=[rank])[0]

    def call_each(self, method: str, per_rank_args: Sequence[Sequence[Any]]) -> list:
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{len(per_rank_args)} argument lists for {self.world_size} ranks")
        return self.wait([getattr(a, method).remote(*args) for a, args in zip(self._actors, per_rank_args)], method)

    def shutdown(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._watch is not None:
            self._watch.close()
