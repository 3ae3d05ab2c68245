"""Ray actors forming one torch.distributed world: gloo collectives work, failures surface, every
socket the ranks listen on is on the loopback address, and a rank killed while a process it forked
holds its connections (megatron's checkpoint writers) is named within seconds."""
import ipaddress
import os
import threading
import time

import psutil
import pytest

ray = pytest.importorskip("ray")

from megarl.cluster.ray_cluster import init_ray, shutdown_ray  # noqa: E402
from megarl.cluster.process_watch import WorkerDied  # noqa: E402
from megarl.cluster.worker_group import DistributedWorker, WorkerGroup  # noqa: E402


class SumWorker(DistributedWorker):
    def setup(self, scale):
        self.scale = scale

    def all_reduce(self, value):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value) * self.scale])
        dist.all_reduce(t)
        return t.item(), dist.get_backend(), dist.get_rank(), dist.get_world_size()

    def timeout_s(self):
        import torch
        import torch.distributed as dist

        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    def fail(self):
        raise RuntimeError(f"rank {self.rank} failed on purpose")

    def process(self):
        return os.getpid(), os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")

    def env(self, name):
        return os.environ.get(name)

    def nap(self, seconds):
        time.sleep(seconds)

    def fork_and_block(self):
        """Fork a child that holds this process's connections (as megatron's checkpoint writers do); block."""
        import multiprocessing as mp

        mp.get_context("fork").Process(target=time.sleep, args=(300,), daemon=False).start()
        time.sleep(300)


@pytest.fixture(scope="module")
def cluster(ray_address):
    init_ray(address=ray_address)
    yield
    shutdown_ray()


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ranks_form_a_gloo_world(cluster):
    # a runtime environment for rank 1 only, as nsys profiling gives the ranks it selects (Ray's nsight plugin)
    group = WorkerGroup(SumWorker, world_size=2, init_args=(10,), dist_timeout_s=77,  # nccl_timeout
                        runtime_env=lambda rank: {"env_vars": {"MEGARL_SELECTED": "1"}} if rank == 1 else None)
    try:
        assert group.call("timeout_s") == [77, 77]
        assert group.call("env", "MEGARL_SELECTED") == [None, "1"]
        results = group.call_each("all_reduce", [(1,), (2,)])
        assert [r[0] for r in results] == [30.0, 30.0]
        assert {r[1] for r in results} == {"gloo"}
        assert [r[2] for r in results] == [0, 1] and {r[3] for r in results} == {2}
        with pytest.raises(ray.exceptions.RayTaskError, match="rank [01] failed on purpose"):
            group.call("fail")
    finally:
        group.shutdown()


@pytest.mark.ray
@pytest.mark.timeout(60)
def test_bad_world_size(cluster):
    with pytest.raises(ValueError, match="world_size >= 1"):
        WorkerGroup(SumWorker, world_size=0)


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ranks_listen_on_loopback_only(cluster):
    """The rendezvous store (rank 0), gloo's pairs and Ray's own servers: none on another interface."""
    group = WorkerGroup(SumWorker, world_size=2, init_args=(1,))
    try:
        assert [r[0] for r in group.call_each("all_reduce", [(1,), (2,)])] == [3.0, 3.0]  # gloo is connected
        processes = group.call("process")
        assert {(gloo, nccl) for _, gloo, nccl in processes} == {("lo", "lo")}
        listening = {(pid, c.laddr.ip, c.laddr.port) for pid, _, _ in processes
                     for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert len(listening) >= 3, listening  # at least the store and one gloo pair per rank
        assert {ip for _, ip, _ in listening if not is_loopback(ip)} == set(), sorted(listening)
    finally:
        group.shutdown()


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_within_seconds(cluster):
    group = WorkerGroup(SumWorker, world_size=2, init_args=(1,))
    pid = group.call_rank(1, "process")[0]

    def kill_once_forked():
        deadline = time.monotonic() + 60
        while not psutil.Process(pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        psutil.Process(pid).kill()

    killer = threading.Thread(target=kill_once_forked, daemon=True)
    killer.start()
    try:
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=rf"trainer rank 1 \(pid {pid} on 127.0.0.1\) died while running "
                                             r"fork_and_block; its output is in trainer_rank1.log"):
            group.call("fork_and_block")
        assert time.monotonic() - start < 60
    finally:
        killer.join()
        group.shutdown()


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_wait_is_bounded_and_names_the_late_ranks(cluster):
    group = WorkerGroup(SumWorker, world_size=2, init_args=(1,))
    try:
        refs = [group.call_async("nap", 0)[0], group.call_async("nap", 60)[1]]
        with pytest.raises(TimeoutError, match=r"a nap: trainer rank\(s\) \[1\] did not finish within 3 s"):
            group.wait(refs, "a nap", timeout_s=3)
    finally:
        group.shutdown()


def test_a_save_past_its_bound_names_the_key():
    from types import SimpleNamespace

    from megarl.trainer.checkpointing import save_on_workers

    class LateWorkers:
        def call_async(self, method, *args):
            return [method]

        def wait(self, refs, what, timeout_s=None):
            raise TimeoutError(f"{what}: trainer rank(s) [0] did not finish within {timeout_s:g} s")

    with pytest.raises(TimeoutError, match=r"save_checkpoint \(step 7\): trainer rank\(s\) \[0\] did not finish "
                                           r"within 5 s: .*raise trainer.save_timeout_s=5"):
        save_on_workers(LateWorkers(), "/ckpt", 7, {}, SimpleNamespace(save_timeout_s=5))
