"""The actors tests/trainer/test_placement.py places on its two-node Ray cluster.

They live here, not in the test module, because Ray's workers import the module that defines an actor's
class: the test module imports megarl's config checks (torch, transformers: 4-5 CPU-seconds in each
probe's process), this one only ``os``.
"""
import os


class Probe:
    """Stands where a Megatron rank or a vLLM replica would: reports what Ray gave it."""

    def __init__(self, device_ids=()):
        if device_ids:  # as EngineReplica does
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(device_ids)

    def where(self):
        import ray

        return (ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()],
                os.environ.get("CUDA_VISIBLE_DEVICES"))


class RayExecutorProbe:
    """Does what vLLM's Ray executor does from a node-spanning replica: one worker per bundle."""

    def workers_where(self):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()  # the run's group, captured by the replica
        bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])

        @ray.remote(num_cpus=0)
        def worker():
            return ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()]

        return ray.get([worker.options(num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=b, placement_group_capture_child_tasks=True)).remote()
            for b in bundles])
