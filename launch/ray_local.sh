#!/usr/bin/env bash
# Run training without Slurm: on this machine, or on a Ray cluster you started yourself.
#
#   bash launch/ray_local.sh CONFIG_NAME [key=value ...]                  # a private local Ray cluster
#   RAY_ADDRESS=10.0.0.1:6379 bash launch/ray_local.sh grpo_70b ...        # join an existing cluster
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: launch/ray_local.sh CONFIG_NAME [key=value ...]" >&2; exit 2; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${MEGARL_PYTHON:-$REPO/.venv/bin/python}
CONFIG=$1; shift
cd "$REPO"
source "$REPO/slurm/env.sh"
exec "$PYTHON" -m megarl.run.train --config-name "$CONFIG" "$@"
