"""Ray actors forming one torch.distributed world: gloo collectives work, failures surface."""
import pytest

ray = pytest.importorskip("ray")

from megarl.cluster.ray_cluster import init_ray, shutdown_ray  # noqa: E402
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


@pytest.fixture(scope="module")
def cluster():
    init_ray(num_cpus=4)
    yield
    shutdown_ray()


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ranks_form_a_gloo_world(cluster):
    group = WorkerGroup(SumWorker, world_size=2, init_args=(10,), dist_timeout_s=77)  # nccl_timeout
    try:
        assert group.call("timeout_s") == [77, 77]
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
