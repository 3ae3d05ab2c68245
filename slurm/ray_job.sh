#!/usr/bin/env bash
# Run a command on a Ray cluster that spans every node of the current Slurm allocation.
#
#   srun/sbatch context:  bash slurm/ray_job.sh python -m megarl.run.train --config-name grpo_70b ...
#
# 1. starts the Ray head on the first node and a Ray worker on every other node (srun, one task
#    per node, `ray start --block` so Slurm owns the processes);
# 2. waits until all nodes have joined (MEGARL_RAY_WAIT_S, default 300 s), else fails;
# 3. runs the command on this (the batch) node with RAY_ADDRESS pointing at the head;
# 4. tears Ray down on every exit path and returns the command's exit code (non-zero if any
#    step failed), so a failed job ends FAILED with no Ray processes left behind;
# 5. forwards SIGUSR1/SIGTERM/SIGINT to the command (Slurm's `--signal=B:USR1@<secs>` warning reaches
#    this shell only) and, when the driver stopped for a forwarded USR1 after its checkpoint,
#    requeues the job last, after the teardown (slurm/signals.sh; MEGARL_REQUEUE=0: no requeue).
#
# Every launcher in launch/ calls this script; it holds all the Slurm/Ray logic.
# Environment: MEGARL_PYTHON (python with megarl installed; default: the repo's .venv),
# MEGARL_RAY_PORT (default 20000 + job id % 10000, clear of Ray's worker ports 10002-19999),
# MEGARL_HEAD_IP (default: the head node's first address), MEGARL_NODE_IP (the address every
# worker node announces; only for single-machine test clusters, e.g. 127.0.0.1), MEGARL_GPUS_PER_NODE (default: Slurm's
# GPU count per node, or 0), MEGARL_CPUS_PER_NODE (default: SLURM_CPUS_ON_NODE).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${MEGARL_PYTHON:-$REPO/.venv/bin/python}
RAY_BIN=$(dirname "$PYTHON")/ray
# shellcheck source=slurm/signals.sh
source "$REPO/slurm/signals.sh"
log() { echo "[ray_job $(date +%H:%M:%S)] $*"; }
die() { echo "[ray_job] error: $*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: ray_job.sh COMMAND [ARGS...] (inside a Slurm allocation)"
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job: submit with sbatch, or use launch/ray_local.sh"
[ -x "$PYTHON" ] || die "$PYTHON not found: set MEGARL_PYTHON to a python with megarl installed (make venv)"
[ -x "$RAY_BIN" ] || die "$RAY_BIN not found next to $PYTHON: install ray in that environment"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NUM_NODES=${#NODES[@]}
HEAD=${NODES[0]}
PORT=${MEGARL_RAY_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
if [ -z "${MEGARL_HEAD_IP:-}" ]; then
    MEGARL_HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname -I 2>/dev/null | awk '{print $1}')
    [ -n "$MEGARL_HEAD_IP" ] || MEGARL_HEAD_IP=127.0.0.1
fi
ADDRESS="$MEGARL_HEAD_IP:$PORT"
GPUS=${MEGARL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
CPUS=${MEGARL_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}
TMP_BASE=${MEGARL_RAY_TMP:-/tmp/ray_${SLURM_JOB_ID}}
# Not RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: it turns the head into a single-node cluster that refuses workers.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0
# No idle workers prestarted for the first driver: they start in that driver's job environment, and a run's actors
# start in environments of their own (as init_ray's local clusters; megarl/cluster/ray_cluster.py says more).
export RAY_prestart_worker_first_driver=${RAY_prestart_worker_first_driver:-0}
unset RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER

STEP_PIDS=()
teardown() {
    local rc=$?
    trap - EXIT INT TERM
    log "tearing down Ray on $NUM_NODES node(s)"
    for pid in "${STEP_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${STEP_PIDS[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null
    done
    wait 2>/dev/null
    rm -rf "$TMP_BASE"
    requeue_if_preempted
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM
trap 'FORWARDED=USR1 DRIVER_RC=138; exit 138' USR1  # Slurm's warning before the driver runs: requeue at once

log "job $SLURM_JOB_ID: $NUM_NODES node(s) [${NODES[*]}], head $HEAD at $ADDRESS, $GPUS GPU(s) and $CPUS CPU(s) per node"
srun --nodes=1 --ntasks=1 --overlap -w "$HEAD" \
    "$RAY_BIN" start --head --block --node-ip-address="$MEGARL_HEAD_IP" --port="$PORT" \
    --num-cpus="$CPUS" --num-gpus="$GPUS" --temp-dir="$TMP_BASE/head" --include-dashboard=false \
    --disable-usage-stats >"$TMP_BASE.head.log" 2>&1 &
STEP_PIDS+=($!)

wait_for_nodes() {  # $1: expected node count; fails fast if a `ray start` step died
    # Asks the head's GCS for its node table (0.5 s) rather than connecting as a driver (ray.init: 2-3 s per poll,
    # and each connection has every raylet start idle worker processes for it).
    "$PYTHON" - "$ADDRESS" "$1" "${MEGARL_RAY_WAIT_S:-300}" "${STEP_PIDS[@]}" <<'PY'
import os, socket, sys, time
address, expected, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
step_pids = [int(p) for p in sys.argv[4:]]
host, port = address.rsplit(":", 1)
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
deadline, alive, client = time.time() + limit, 0, None
while time.time() < deadline:
    for pid in step_pids:
        try:
            os.kill(pid, 0)
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                raise ProcessLookupError
        except (ProcessLookupError, FileNotFoundError):
            print(f"[ray_job] error: a `ray start` step (pid {pid}) exited before its node joined", file=sys.stderr)
            sys.exit(1)
    try:
        if client is None:  # a client made before the head listens waits 40 s for it: knock first
            socket.create_connection((host, int(port)), timeout=2).close()
            client = GcsClient(address=address)
        nodes = client.get_all_node_info(timeout=5).values()
        alive = sum(1 for node in nodes if node.state == GcsNodeInfo.ALIVE)
        if alive >= expected:
            print(f"[ray_job] {alive} Ray node(s) alive")
            sys.exit(0)
    except Exception:  # the head is not up yet
        client = None
    time.sleep(1)
print(f"[ray_job] error: only {alive} of {expected} Ray node(s) joined within {limit:.0f} s", file=sys.stderr)
sys.exit(1)
PY
}

mkdir -p "$(dirname "$TMP_BASE")"
wait_for_nodes 1 || { tail -20 "$TMP_BASE.head.log" >&2; die "the Ray head did not start on $HEAD"; }
for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 --overlap -w "$node" \
        "$RAY_BIN" start --block --address="$ADDRESS" ${MEGARL_NODE_IP:+--node-ip-address=$MEGARL_NODE_IP} \
        --num-cpus="$CPUS" --num-gpus="$GPUS" \
        --temp-dir="$TMP_BASE/$node" --disable-usage-stats >"$TMP_BASE.$node.log" 2>&1 &
    STEP_PIDS+=($!)
done
wait_for_nodes "$NUM_NODES" || die "not every node joined the Ray cluster (logs: $TMP_BASE.*.log)"

export RAY_ADDRESS="$ADDRESS"
log "running: $*"
run_forwarding_signals "$@"
rc=$DRIVER_RC
trap 'exit 130' INT TERM
trap '' USR1  # the warning is handled: the driver has stopped
log "command exited with $rc${FORWARDED:+ after SIG$FORWARDED}"
exit "$rc"
