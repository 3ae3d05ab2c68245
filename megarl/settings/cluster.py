"""Where the run's processes go, from the config: the cluster's shape (``trainer.nnodes`` x
``n_gpus_per_node``, ``trainer.placement``, ``trainer.rollout_gpus`` or verl's rollout pool), the
rollout fleet's TP and replica count, and a reward model's placement (colocated on the trainer's
devices, or its own pool: ``reward_model.enable_resource_pool``, ``nnodes``, ``n_gpus_per_node``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.cluster.placement import PlacementPlan, plan_placement, plan_reward_pool, with_colocated_reward_model
from megarl.config.derived import cluster_shape


def plan_from_config(cfg) -> PlacementPlan:
    rollout, rm = cfg.actor_rollout_ref.rollout, cfg.reward_model
    nnodes, per_node, mode, rollout_devices = cluster_shape(cfg)
    plan = plan_placement(nnodes, per_node, mode, rollout.tensor_model_parallel_size, rollout_devices,
                          rollout.num_replicas)
    if rm.enable and not rm.enable_resource_pool:
        plan = with_colocated_reward_model(plan, rm.rollout.tensor_model_parallel_size)
    return plan


@dataclass(frozen=True)
class RaySettings:
    """How the driver joins or starts Ray: ``trainer.ray_address``, ``ray_kwargs.ray_init.num_cpus``
    (None: the machine's cores, at least one per device slot), ``ray_kwargs.timeline_json_file``."""

    address: str | None
    num_cpus: int | None
    timeline_json_file: str | None


def ray_settings(cfg) -> RaySettings:
    ray = cfg.ray_kwargs
    return RaySettings(cfg.trainer.ray_address, ray.ray_init.num_cpus, ray.timeline_json_file)


def reward_pool_from_config(cfg) -> PlacementPlan | None:
    """The reward model's own pool, when ``reward_model.enable_resource_pool`` asks for one."""
    rm = cfg.reward_model
    if not (rm.enable and rm.enable_resource_pool):
        return None
    return plan_reward_pool(rm.nnodes, rm.n_gpus_per_node, rm.rollout.tensor_model_parallel_size)
