"""The Ray cluster that the heavy tests join (``ray_address`` in tests/conftest.py), in a process of its own.

Starting a local cluster and stopping it costs 4-5 s on 2 cores; joining one costs under 1 s. So
the in-process runs and the module fixtures that only need *a* cluster join this one, each as a Ray
job of its own, as a run joins the cluster ``slurm/`` starts: its actors, placement groups and
worker environment go with its connection. Tests of the local cluster itself (its privacy, its temp
dir, the reaper after a killed driver) keep starting their own.

    python -m tests.ray_head      # prints the cluster's address, runs until its stdin closes
"""
import sys

NUM_CPUS = 16  # above the slots any joining test places; CPUs are a count for Ray here, not cores


def main() -> None:
    import ray

    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    init_ray(num_cpus=NUM_CPUS)
    print(ray.get_runtime_context().gcs_address, flush=True)
    try:
        sys.stdin.read()  # until the suite closes it, or ends without closing it
    finally:
        shutdown_ray()


if __name__ == "__main__":
    main()
