"""Start or join the Ray cluster that hosts the rollout fleet and the trainer workers.

    init_ray()                      # $RAY_ADDRESS if set, else a private local cluster
    init_ray(address="10.0.0.1:6379")
    ...
    shutdown_ray()

A local cluster is bound to 127.0.0.1, has Ray's token auth switched off (it breaks a second
client on the same machine) and gets its own temp dir, so several clusters on one machine (tests
run side by side, other users) never find each other's ``ray_current_cluster`` file. Its GCS port
is picked by the OS from the ephemeral range (32768-60999), clear of the 10002-19999 range Ray
uses for worker ports. Never call ``ray stop``: it kills every Ray process on the machine; a
cluster started here ends with ``shutdown_ray()``.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

# Set before Ray starts any process; setdefault so that a user's explicit choice wins.
_LOCAL_CLUSTER_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps a local cluster on 127.0.0.1 (measured)
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}

_created_temp_dir: str | None = None


def init_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None,
             num_gpus: int | None = None) -> dict:
    """Connect to a Ray cluster, or start a local one; return ``ray.cluster_resources()``.

    ``address`` (or ``$RAY_ADDRESS`` when ``address`` is None) joins an existing cluster, e.g. the
    one ``slurm/`` starts inside a job; ``num_cpus``/``num_gpus``/``temp_dir`` are then ignored,
    because a running cluster's resources are fixed. Without an address a local cluster starts
    with ``num_cpus`` CPUs (default: all of this machine's) and its own temp dir (default: a new
    directory under /tmp, removed again by ``shutdown_ray``). Calling it while Ray is already
    initialised in this process returns the current cluster's resources.
    """
    global _created_temp_dir
    for key, value in _LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True)
        return ray.cluster_resources()

    if temp_dir is None:
        # Short path: Ray puts unix sockets under it, and those are limited to 107 bytes.
        temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
        _created_temp_dir = temp_dir
        atexit.register(shutdown_ray)  # also when the driver dies of an exception
    os.environ.pop("RAY_ADDRESS", None)  # an empty RAY_ADDRESS would make Ray look for a cluster
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
    )
    resources = ray.cluster_resources()
    logger.info("started a local Ray cluster (temp dir %s): %s", temp_dir, resources)
    return resources


def shutdown_ray() -> None:
    """Disconnect from Ray; a local cluster started by ``init_ray`` stops and its temp dir goes."""
    global _created_temp_dir
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if _created_temp_dir is not None:
        shutil.rmtree(_created_temp_dir, ignore_errors=True)
        _created_temp_dir = None
