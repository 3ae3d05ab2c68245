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

A driver that dies without ``shutdown_ray`` (SIGKILL) leaves nothing behind for long: a reaper
process beside a local cluster kills the cluster's processes and removes its temp dir as soon as
the driver is gone; a new local cluster first removes the temp dirs of dead runs whose reaper died
too (``run_reaper``).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

from megarl.platform.gc_tuning import GC_THRESHOLD_ENV, RAY_WORKER_SETUP_HOOK

logger = logging.getLogger(__name__)

# Set before Ray starts any process; setdefault so that a user's explicit choice wins.
_LOCAL_CLUSTER_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps a local cluster on 127.0.0.1 (measured)
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray starts idle workers for a cluster's first driver, in that driver's job environment; a run's actors start
    # in environments of their own, so those workers only cost CPU (measured: 1.5 CPU-s and 2.5-3 s of start-up
    # per run of the quickstart on 2 cores, and 0.6 CPU-s a minute each while the cluster is up)
    "RAY_prestart_worker_first_driver": "0",
}

_created_temp_dir: str | None = None
_reaper = None  # run_reaper.Reaper of the local cluster


def init_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None,
             num_gpus: int | None = None, worker_env: dict[str, str] | None = None,
             private_tmp: bool = False) -> dict:
    """Connect to a Ray cluster, or start a local one; return ``ray.cluster_resources()``.

    ``address`` (or ``$RAY_ADDRESS`` when ``address`` is None) joins an existing cluster, e.g. the
    one ``slurm/`` starts inside a job; ``num_cpus``/``num_gpus``/``temp_dir`` are then ignored,
    because a running cluster's resources are fixed. Without an address a local cluster starts
    with ``num_cpus`` CPUs (default: all of this machine's) and its own temp dir (default: a new
    directory under /tmp, removed again by ``shutdown_ray``). Calling it while Ray is already
    initialised in this process returns the current cluster's resources.

    ``worker_env`` is set in every worker process of this job (Ray merges it with an actor's own
    ``runtime_env``). ``private_tmp`` (local cluster only) points the workers' ``TMPDIR`` into the
    cluster's temp dir, so the files vLLM and torch leave in the temp dir (rendezvous files,
    sockets) go with it.
    """
    global _created_temp_dir
    for key, value in _LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()

    env = dict(worker_env or {})
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True, runtime_env=_job_runtime_env(env))
        return ray.cluster_resources()

    if temp_dir is None:
        from megarl.cluster import run_reaper

        run_reaper.remove_stale_temp_dirs("/tmp")
        # Short path: Ray puts unix sockets under it, and those are limited to 107 bytes.
        temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
        _created_temp_dir = temp_dir
        atexit.register(shutdown_ray)  # also when the driver dies of an exception
        run_reaper.write_marker(temp_dir)
        _start_reaper(temp_dir)
    if private_tmp:
        env["TMPDIR"] = os.path.join(temp_dir, "tmp")
        os.makedirs(env["TMPDIR"], exist_ok=True)
    os.environ.pop("RAY_ADDRESS", None)  # an empty RAY_ADDRESS would make Ray look for a cluster
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
        runtime_env=_job_runtime_env(env),
    )
    resources = ray.cluster_resources()
    logger.info("started a local Ray cluster (temp dir %s): %s", temp_dir, resources)
    return resources


def _job_runtime_env(env: dict[str, str]) -> dict:
    """The run's Ray job environment: ``env`` in every worker, and megarl's collector settings applied in each
    worker before anything loads there (``megarl.platform.gc_tuning``; an actor's own ``runtime_env`` keeps it).
    The driver's ``$MEGARL_GC_THRESHOLD`` goes along: a joined cluster's workers descend from ``ray start``,
    not from the driver."""
    runtime_env: dict = {"worker_process_setup_hook": RAY_WORKER_SETUP_HOOK}
    if GC_THRESHOLD_ENV in os.environ:
        env = {GC_THRESHOLD_ENV: os.environ[GC_THRESHOLD_ENV], **env}
    if env:
        runtime_env["env_vars"] = env
    return runtime_env


def _start_reaper(temp_dir: str) -> None:
    global _reaper
    from megarl.cluster.run_reaper import start_reaper

    _reaper = start_reaper(temp_dir)


def local_temp_dir() -> str | None:
    """The temp dir of the local cluster ``init_ray`` started (None when it joined one, or none runs)."""
    return _created_temp_dir


def remove_local_temp_dir() -> None:
    """Remove the local cluster's temp dir at once, whatever still runs (a second Ctrl-C kills the run)."""
    if _created_temp_dir is not None:
        shutil.rmtree(_created_temp_dir, ignore_errors=True)


def _cluster_processes(temp_dir: str) -> list:
    """The local cluster's processes: Ray's own (their command lines name the temp dir) and their descendants
    (the workers and what they started, e.g. vLLM's engine processes)."""
    import psutil

    found: dict[int, psutil.Process] = {}
    reaper = _reaper.process.pid if _reaper is not None else None  # it outlives the cluster: it goes last
    for child in psutil.Process().children(recursive=True):
        if child.pid == reaper:
            continue
        try:
            if any(temp_dir in arg for arg in child.cmdline()):
                found[child.pid] = child
                found.update((p.pid, p) for p in child.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def shutdown_ray() -> None:
    """Disconnect from Ray; a local cluster started by ``init_ray`` stops, its processes are waited
    for (killed after 15 s) and its temp dir goes."""
    global _created_temp_dir
    import ray

    processes = _cluster_processes(_created_temp_dir) if _created_temp_dir is not None else []
    if ray.is_initialized():
        ray.shutdown()
    if processes:
        import psutil

        _, alive = psutil.wait_procs(processes, timeout=15)
        for process in alive:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
    if _created_temp_dir is not None:
        shutil.rmtree(_created_temp_dir, ignore_errors=True)
        _created_temp_dir = None
    _stop_reaper()


def _stop_reaper() -> None:
    """After the cluster is down: the reaper finds nothing left and ends."""
    global _reaper
    if _reaper is not None:
        _reaper.stop()
        _reaper = None
