#!/usr/bin/env bash
# A real 2-node Slurm cluster on this one machine, for tests and for trying the launchers.
#
#   slurm/local_cluster.sh up       install slurm + munge from Debian if missing, start the daemons
#   slurm/local_cluster.sh status   sinfo
#   slurm/local_cluster.sh down     stop the daemons this script started (by pid) and remove state
#
# Two nodes n1, n2 share 127.0.0.1 (Debian's build has multiple-slurmd). proctrack/cgroup kills a
# job's background processes (a Ray head, say) when the job ends. Accounting is off: use squeue and
# `scontrol show job`, not sacct. State, logs and pid files live in $MEGARL_SLURM_DIR.
set -euo pipefail

STATE=${MEGARL_SLURM_DIR:-/tmp/megarl-slurm}
CONF="$STATE/slurm.conf"
CTLD_PORT=${MEGARL_SLURMCTLD_PORT:-16817}
NODE_PORTS=${MEGARL_SLURMD_PORTS:-17001-17002}
NODES=${MEGARL_SLURM_NODES:-2}
CPUS=${MEGARL_SLURM_CPUS:-2}

log() { echo "[local_cluster] $*"; }
die() { echo "[local_cluster] error: $*" >&2; exit 1; }

install_packages() {
    local missing=()
    for bin in slurmctld slurmd sbatch munged; do command -v "$bin" >/dev/null || missing+=("$bin"); done
    [ ${#missing[@]} -eq 0 ] && return
    [ "$(id -u)" = 0 ] || die "slurm is not installed and installing it needs root: apt-get install slurmctld slurmd slurm-client munge"
    log "installing slurmctld slurmd slurm-client munge (Debian packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
    mkdir -p "$STATE"
    local host; host=$(hostname)
    cat > "$CONF" <<CONF
ClusterName=megarl-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd.%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.%n.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/linear
EnforcePartLimits=ALL
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$NODE_PORTS CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
CONF
    cat > "$STATE/cgroup.conf" <<CONF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
CONF
    mkdir -p "$STATE/ctld"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null >/dev/null 2>&1; then return; fi
    mkdir -p /run/munge && chown munge:munge /run/munge
    [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing; reinstall munge (it creates the key)"
    rm -f /run/munge/munged.pid
    runuser -u munge -- munged --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n </dev/null >/dev/null 2>&1 || die "munged did not start"
    # record munged's pid as started by us, so `down` stops only what `up` started
    cp /run/munge/munged.pid "$STATE/munged.pid"
}

up() {
    install_packages
    if alive "$STATE/slurmctld.pid"; then log "already up (state in $STATE)"; sinfo; return; fi
    write_config
    start_munge
    export SLURM_CONF="$CONF"
    slurmctld -f "$CONF" || die "slurmctld failed; see $STATE/slurmctld.log"
    for i in $(seq 1 "$NODES"); do
        mkdir -p "$STATE/slurmd.n$i"
        slurmd -f "$CONF" -N "n$i" || die "slurmd n$i failed; see $STATE/slurmd.n$i.log"
    done
    for _ in $(seq 100); do
        idle=$(sinfo -h -N -t idle -o "%N" 2>/dev/null | sort -u | wc -l)
        [ "$idle" -ge "$NODES" ] && break
        sleep 0.2
    done
    [ "${idle:-0}" -ge "$NODES" ] || { sinfo -N -l >&2 || true; die "nodes did not become idle; see $STATE/*.log"; }
    log "up: $NODES nodes idle. export SLURM_CONF=$CONF"
    sinfo
}

down() {
    local pidfile
    for pidfile in "$STATE"/slurmd.n*.pid "$STATE/slurmctld.pid" "$STATE/munged.pid"; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid" || true
        fi
        rm -f "$pidfile"
    done
    rm -rf "$STATE"
    log "down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) SLURM_CONF="$CONF" sinfo -N -l ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
