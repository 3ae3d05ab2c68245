#!/usr/bin/env bash
# The one bootstrap every sbatch launcher in launch/ calls:
#
#   bash slurm/launch.sh CONFIG_NAME [key=value ...]
#
# 1. finds the repository and its python (MEGARL_REPO, MEGARL_PYTHON);
# 2. sets the NCCL / InfiniBand environment on GPU clusters (slurm/env.sh);
# 3. passes the job's shape and the user's paths to the trainer as overrides:
#      trainer.nnodes        <- SLURM_JOB_NUM_NODES
#      trainer.n_gpus_per_node <- MEGARL_GPUS_PER_NODE or SLURM_GPUS_ON_NODE
#      actor_rollout_ref.model.path <- MODEL_PATH        (if set)
#      data.train_files / data.val_files <- TRAIN_FILES / VAL_FILES (if set)
#      trainer.default_local_dir <- CKPT_DIR             (if set)
#    then any key=value given on the command line (they win);
# 4. runs `python -m megarl.run.train` inside slurm/ray_job.sh (Ray head + workers, teardown).
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: slurm/launch.sh CONFIG_NAME [key=value ...]" >&2; exit 2; }
CONFIG=$1; shift
REPO=${MEGARL_REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
[ -f "$REPO/slurm/ray_job.sh" ] || { echo "slurm/launch.sh: $REPO is not the megarl repository; submit from the repo root or set MEGARL_REPO" >&2; exit 2; }
export MEGARL_PYTHON=${MEGARL_PYTHON:-$REPO/.venv/bin/python}
cd "$REPO"
# shellcheck source=slurm/env.sh
source "$REPO/slurm/env.sh"

GPUS=${MEGARL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
OVERRIDES=("trainer.nnodes=${SLURM_JOB_NUM_NODES:-1}")
[ "$GPUS" -gt 0 ] && OVERRIDES+=("trainer.n_gpus_per_node=$GPUS")
[ -n "${MODEL_PATH:-}" ] && OVERRIDES+=("actor_rollout_ref.model.path=$MODEL_PATH")
[ -n "${TRAIN_FILES:-}" ] && OVERRIDES+=("data.train_files=$TRAIN_FILES")
[ -n "${VAL_FILES:-}" ] && OVERRIDES+=("data.val_files=$VAL_FILES")
[ -n "${CKPT_DIR:-}" ] && OVERRIDES+=("trainer.default_local_dir=$CKPT_DIR")

# Fail before any node starts Ray if the config is wrong.
"$MEGARL_PYTHON" -m megarl.run.cli config show "$CONFIG" "${OVERRIDES[@]}" "$@" >/dev/null

exec bash "$REPO/slurm/ray_job.sh" "$MEGARL_PYTHON" -m megarl.run.train --config-name "$CONFIG" "${OVERRIDES[@]}" "$@"
