"""Where every process of a run sits: Megatron ranks and vLLM replicas on the cluster's devices.

    plan = plan_from_config(cfg)                    # pure: which device slots each process uses
    placement = ClusterPlacement(plan, use_gpu)     # Ray: the devices reserved, slots mapped to nodes
    workers = WorkerGroup(MegatronWorker, plan.trainer_world, slots=placement.trainer_slots(), ...)
    fleet = RolloutFleet(rollout_settings, model, slots=placement.replica_slots(), ...)

The cluster is ``trainer.nnodes`` nodes of ``trainer.n_gpus_per_node`` device slots (GPUs; on a
CPU machine, worker processes), numbered node-major. All slots are the bundles of one Ray
placement group (``{"GPU": 1, "CPU": c}`` each, or ``{"CPU": c}`` without GPUs).

* ``colocated``: trainer rank ``r`` uses slot ``r`` of all ``nnodes * n_gpus_per_node`` slots;
  replica ``i`` (TP ``t``) uses slots ``[i*t, (i+1)*t)`` of the same slots. Both take half of
  each bundle's GPU; they share the memory by time: the engines sleep while the trainer works
  (``rollout.free_cache_engine``; see ``rollout_memory.py``).
* ``split``: the first ``world - trainer.rollout_gpus`` slots are the trainer's, the last
  ``trainer.rollout_gpus`` the fleet's, each with whole GPUs; nobody sleeps.

A reward model or LLM judge (``reward_model.enable``, ``megarl.rewards.reward_models``) runs on vLLM
replicas too: on the trainer's slots (``reward_model.enable_resource_pool=False``, verl's colocated
mode; its engines sleep outside the reward pass), or on a pool of its own
(``reward_model.nnodes x reward_model.n_gpus_per_node`` devices, another placement group:
``plan_reward_pool``). Distillation teachers have a pool of their own likewise (``plan_teacher_pool``).
Processes that share a slot share its bundle evenly (``share_of``).

A replica's TP group stays within one node (vLLM's "mp" executor: the replica actor sits in its
first slot's bundle and, on GPU, exposes exactly its slots' GPUs to vLLM through
``CUDA_VISIBLE_DEVICES``) or covers whole nodes (TP 16 or 32 for a 671B model: vLLM's Ray
executor starts one TP worker in each of the replica's bundles, ``VLLM_RAY_BUNDLE_INDICES``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence



@dataclass(frozen=True)
class PlacementPlan:
    """Device slots (global, node-major: slot ``s`` is bundle ``s % per_node`` of node ``s // per_node``)."""

    nnodes: int
    per_node: int
    mode: str  # colocated | split
    trainer: tuple[int, ...]  # slot of trainer rank r
    replicas: tuple[tuple[int, ...], ...]  # slots of replica i (its TP ranks in order)
    reward_replicas: tuple[tuple[int, ...], ...] = ()  # a colocated reward model's replicas (on trainer slots)

    @property
    def trainer_world(self) -> int:
        return len(self.trainer)

    def share_of(self, slot: int) -> float:
        """The fraction of a slot's bundle (GPU and CPU) each process on it takes: the trainer rank,
        a rollout replica's TP rank and a reward-model replica's TP rank share it evenly."""
        occupants = (slot in self.trainer) + sum(slot in r for r in self.replicas + self.reward_replicas)
        return 1.0 / max(occupants, 1)

    @property
    def share(self) -> float:
        """The share of the most crowded slot (half each when trainer and rollout are colocated)."""
        slots = set(self.trainer).union(*self.replicas, *self.reward_replicas)
        return min(self.share_of(s) for s in slots)

    def node_of(self, slot: int) -> int:
        return slot // self.per_node

    def bundle_of(self, slot: int) -> int:
        return slot % self.per_node


def plan_placement(nnodes: int, per_node: int, mode: str, rollout_tp: int, rollout_devices: int | None = None,
                   num_replicas: int | None = None) -> PlacementPlan:
    """The slots of every trainer rank and replica; a ValueError naming the key to change if impossible.

    ``rollout_devices`` is ``trainer.rollout_gpus`` (split only); ``num_replicas`` defaults to as
    many as the rollout slots hold (``rollout_devices // rollout_tp``).
    """
    if nnodes < 1 or per_node < 1:
        raise ValueError(f"trainer.nnodes={nnodes} and trainer.n_gpus_per_node={per_node} must both be >= 1")
    world = nnodes * per_node
    if mode == "colocated":
        trainer = tuple(range(world))
        rollout_slots = list(range(world))
    elif mode == "split":
        if not rollout_devices or not 0 < rollout_devices < world:
            raise ValueError(f"trainer.rollout_gpus={rollout_devices}: split placement needs 0 < rollout_gpus < "
                             f"nnodes * n_gpus_per_node = {world}")
        trainer = tuple(range(world - rollout_devices))
        rollout_slots = list(range(world - rollout_devices, world))
    else:
        raise ValueError(f"trainer.placement={mode!r}: use 'colocated' or 'split'")
    if rollout_tp < 1 or len(rollout_slots) % rollout_tp:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} must divide the "
                         f"{len(rollout_slots)} rollout devices ({mode} placement)")
    most = len(rollout_slots) // rollout_tp
    count = most if num_replicas is None else num_replicas
    if not 1 <= count <= most:
        raise ValueError(f"actor_rollout_ref.rollout.num_replicas={num_replicas}: {len(rollout_slots)} rollout "
                         f"devices hold 1 to {most} replicas of TP={rollout_tp}")
    replicas = tuple(tuple(rollout_slots[i * rollout_tp:(i + 1) * rollout_tp]) for i in range(count))
    for i, slots in enumerate(replicas):
        nodes = sorted({s // per_node for s in slots})
        whole_nodes = slots[0] % per_node == 0 and len(slots) % per_node == 0
        if len(nodes) > 1 and not whole_nodes:
            raise ValueError(f"rollout replica {i} (TP={rollout_tp}) would span nodes {nodes} (device slots "
                             f"{list(slots)}) without filling them: a replica's TP either stays within a node "
                             f"or covers whole nodes; pick a rollout TP that divides or is a multiple of "
                             f"trainer.n_gpus_per_node={per_node}, and a trainer.rollout_gpus that starts the "
                             f"rollout devices on a node boundary")
    return PlacementPlan(nnodes, per_node, mode, trainer, replicas)


def _replica_groups(slots: Sequence[int], tp: int, per_node: int, what: str, key: str) -> tuple[tuple[int, ...], ...]:
    """``slots`` cut into TP groups; each stays within a node or covers whole nodes."""
    if tp < 1 or len(slots) % tp:
        raise ValueError(f"{key}={tp} must divide the {len(slots)} devices of the {what}")
    groups = tuple(tuple(slots[i * tp:(i + 1) * tp]) for i in range(len(slots) // tp))
    for i, group in enumerate(groups):
        nodes = {s // per_node for s in group}
        if len(nodes) > 1 and not (group[0] % per_node == 0 and len(group) % per_node == 0):
            raise ValueError(f"{what} replica {i} (TP={tp}) would span nodes {sorted(nodes)} without filling them; "
                             f"pick a {key} that divides or is a multiple of {per_node} devices per node")
    return groups


def with_colocated_reward_model(plan: PlacementPlan, tp: int) -> PlacementPlan:
    """``plan`` plus reward-model replicas of TP ``tp`` on the trainer's slots (verl's colocated mode:
    as many replicas as the trainer's devices hold)."""
    groups = _replica_groups(list(plan.trainer), tp, plan.per_node, "trainer's devices (a colocated reward model)",
                             "reward_model.rollout.tensor_model_parallel_size")
    return dataclasses.replace(plan, reward_replicas=groups)


def plan_reward_pool(nnodes: int, per_node: int, tp: int) -> PlacementPlan:
    """A reward model's own pool (``reward_model.enable_resource_pool``): ``nnodes x per_node``
    devices, all of them replicas of TP ``tp`` (each process has its slot to itself)."""
    if nnodes < 1 or per_node < 1:
        raise ValueError(f"reward_model.enable_resource_pool=True needs reward_model.nnodes={nnodes} and "
                         f"reward_model.n_gpus_per_node={per_node} >= 1 (the reward model's own devices)")
    groups = _replica_groups(list(range(nnodes * per_node)), tp, per_node, "reward model's pool",
                             "reward_model.rollout.tensor_model_parallel_size")
    return PlacementPlan(nnodes, per_node, "pool", (), groups)


def plan_teacher_pool(nnodes: int, per_node: int, teachers: Sequence[tuple[int, int]]) -> PlacementPlan:
    """The distillation teachers' own pool (``distillation.nnodes x n_gpus_per_node`` devices): each
    teacher's ``(num_replicas, tp)`` replicas, in order, fill it exactly."""
    world = nnodes * per_node
    if world < 1 or sum(count * tp for count, tp in teachers) != world:
        raise ValueError(f"the teachers' replicas ({', '.join(f'{c} x TP{t}' for c, t in teachers)}) must fill "
                         f"their pool of distillation.nnodes={nnodes} x n_gpus_per_node={per_node} devices")
    groups, start = [], 0
    for count, tp in teachers:
        groups += _replica_groups(list(range(start, start + count * tp)), tp, per_node, "teachers' pool",
                                  "distillation.teacher_models.*.inference.tensor_model_parallel_size")
        start += count * tp
    return PlacementPlan(nnodes, per_node, "pool", (), tuple(groups))


@dataclass(frozen=True)
class ActorSlot:
    """Where to start one actor: a bundle of the run's placement group, its share, the devices it drives.

    ``bundle_indices`` are the bundles of every slot the actor drives (a replica: one per TP rank);
    ``device_ids`` their GPU ids (GPU only); ``spans_nodes`` is True for a replica whose TP
    crosses nodes, which vLLM then runs with its Ray executor on exactly those bundles.
    """

    placement_group: Any
    bundle_index: int
    num_cpus: float
    num_gpus: float
    node_id: str
    bundle_indices: tuple[int, ...] = ()
    device_ids: tuple[str, ...] = ()
    spans_nodes: bool = False
    share: float = 1.0  # of each driven bundle's GPU

    def vllm_env(self) -> dict[str, str]:
        """For a node-spanning replica: the bundles and GPU share of its Ray-executor TP workers."""
        if not self.spans_nodes:
            return {}
        return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, self.bundle_indices)),
                "VLLM_RAY_PER_WORKER_GPUS": f"{self.share:g}"}

    def options(self) -> dict[str, Any]:
        """Ray ``.options(...)`` that start an actor in this slot (child tasks stay in the group)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=self.bundle_index,
            placement_group_capture_child_tasks=self.spans_nodes))


class ClusterPlacement:
    """The plan made real: one placement group of one bundle per device slot, reserved up front.

    Ray packs the bundles onto the nodes; a probe task in every bundle reads its node (and GPU id),
    and the slots are numbered node-major from that, so slot ``s`` really is device ``s % per_node``
    of a node and a node-local replica's slots really share a machine. One group (rather than one
    per node) lets a replica whose TP spans nodes hand vLLM's Ray executor the bundles of its slots.
    """

    def __init__(self, plan: PlacementPlan, use_gpu: bool, cpus_per_slot: float = 1, timeout_s: float = 300):
        import ray
        from ray.util.placement_group import placement_group

        self.plan, self.use_gpu = plan, use_gpu
        self.bundle = {"CPU": cpus_per_slot, **({"GPU": 1} if use_gpu else {})}
        world = plan.nnodes * plan.per_node
        self.group = placement_group([dict(self.bundle) for _ in range(world)], strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            self.close()
            raise TimeoutError(
                f"Ray could not reserve {plan.nnodes} node(s) x {plan.per_node} bundles of {self.bundle} within "
                f"{timeout_s:g} s. Cluster: {_node_summary()}. Check trainer.nnodes and trainer.n_gpus_per_node "
                f"against the cluster.")
        probed = self._probe(world)  # bundle -> (node id, gpu id)
        nodes = list(dict.fromkeys(node for node, _ in probed))
        self.slot_bundle = sorted(range(world), key=lambda b: (nodes.index(probed[b][0]), b))
        self.slot_node = [probed[b][0] for b in self.slot_bundle]
        self.slot_device = [probed[b][1] for b in self.slot_bundle]
        if use_gpu:  # a configured node must be one machine (TP groups, NVLink, vLLM's local TP workers)
            for node in range(plan.nnodes):
                machines = {self.slot_node[s] for s in range(node * plan.per_node, (node + 1) * plan.per_node)}
                if len(machines) > 1:
                    self.close()
                    raise RuntimeError(
                        f"Ray placed the {plan.per_node} GPUs of node {node} on {len(machines)} machines: set "
                        f"trainer.n_gpus_per_node to the GPUs per machine and trainer.nnodes to the machines. "
                        f"Cluster: {_node_summary()}")

    def _probe(self, world: int) -> list[tuple[str, str]]:
        """(node id, GPU id or "") of every bundle, read by a tiny task inside it."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=0)
        def where():
            gpus = [str(i) for i in ray.get_gpu_ids()]
            return ray.get_runtime_context().get_node_id(), gpus

        options = dict(num_gpus=0.01) if self.use_gpu else {}
        refs = [where.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=b)).remote() for b in range(world)]
        found = ray.get(refs)
        if self.use_gpu and any(len(gpus) != 1 for _, gpus in found):
            raise RuntimeError(f"expected one GPU per placement bundle, Ray reported {[g for _, g in found]}")
        return [(node, gpus[0] if self.use_gpu else "") for node, gpus in found]

    def _slot(self, slot: int, driven: Sequence[int] = (), spans_nodes: bool = False) -> ActorSlot:
        share = self.plan.share_of(slot)
        return ActorSlot(self.group, self.slot_bundle[slot], num_cpus=self.bundle["CPU"] * share,
                         num_gpus=share if self.use_gpu and not spans_nodes else 0, node_id=self.slot_node[slot],
                         bundle_indices=tuple(self.slot_bundle[s] for s in driven),
                         device_ids=tuple(self.slot_device[s] for s in driven) if self.use_gpu else (),
                         spans_nodes=spans_nodes, share=share)

    def trainer_slots(self) -> list[ActorSlot]:
        return [self._slot(s) for s in self.plan.trainer]

    def replica_slots(self) -> list[ActorSlot]:
        """Replica ``i`` starts in its first slot's bundle; a node-spanning one takes no GPU itself
        (its TP workers, started by vLLM's Ray executor, take each bundle's share)."""
        return self._replica_slots(self.plan.replicas)

    def reward_slots(self) -> list[ActorSlot]:
        """The reward model's replicas: colocated on the trainer's slots, or every slot of its own pool."""
        return self._replica_slots(self.plan.reward_replicas) if self.plan.reward_replicas else self.pool_slots()

    def pool_slots(self) -> list[ActorSlot]:
        """The replicas of a pool of their own (a reward model's, the distillation teachers'), in order."""
        return self._replica_slots(self.plan.replicas if self.plan.mode == "pool" else ())

    def _replica_slots(self, groups) -> list[ActorSlot]:
        return [self._slot(slots[0], slots, spans_nodes=len({self.plan.node_of(s) for s in slots}) > 1)
                for slots in groups]

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - already gone with its cluster
                pass
        self.group = None


def _node_summary() -> str:
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    return ", ".join(f"{n['NodeManagerAddress']}: {n['Resources'].get('GPU', 0):g} GPU "
                     f"{n['Resources'].get('CPU', 0):g} CPU" for n in nodes) or "no live nodes"
