#!/usr/bin/env bash
# The first thing to run on a GPU machine (docs/benchmarks.md, GPU check): bf16 engine logits against HF, a
# training step's tokens/s and MFU, the CUDA-IPC and NCCL weight sync against a device copy, and
# offload round trips, one line each, in under 8 minutes (scripts/gpu_check.py has the details).
#
#   scripts/gpu_check.sh --wheels          # print the wheels a machine without them needs (pinned)
#   scripts/gpu_check.sh --prepare         # here, with network: download them into .whl/ (.gitignore'd)
#   scripts/gpu_check.sh [gpu_check.py arguments]   # there: install .whl/ if present, then run the checks
#
# A lent machine (Python 3.12, torch, transformers, accelerate; no vLLM, no Ray, no network) lacks
# megatron-core and omegaconf (with its parser runtime): --prepare fetches them as wheels for
# CPython 3.12 x86-64 (about 3 MiB, well inside the 64 MiB a call may carry); carry .whl with the
# call. vLLM, Ray and Hydra are not needed: none of the checks imports them. Transformer Engine is
# used where it is already installed (its wheels are far over the carry limit).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  "megatron-core==0.16.1"          # setup.py's pin; compiled, so fetched for cp312
  "omegaconf==2.3.1"               # megarl.engine.settings
  "antlr4-python3-runtime==4.9.3"  # omegaconf's parser; sdist only on PyPI, built into a wheel here
)
PYTHON=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/megarl_gpu_check_site}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}   # the whole run, under 8 minutes

case "${1:-}" in
  --wheels)
    printf '%s\n' "${WHEELS[@]}"
    exit 0
    ;;
  --prepare)
    mkdir -p .whl
    for spec in "${WHEELS[@]}"; do
      if [[ $spec == antlr4-python3-runtime* ]]; then  # pure Python, no wheel on PyPI: build one
        "$PYTHON" -m pip wheel -q --no-deps -w .whl "$spec"
      else
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
          --platform manylinux2014_x86_64 -d .whl "$spec"
      fi
    done
    total=$(du -cm .whl/*.whl | tail -1 | cut -f1)
    ls -1 .whl/*.whl
    echo "gpu_check: ${total} MiB of wheels in .whl/ (limit 64 MiB a call); carry .whl and run scripts/gpu_check.sh"
    [[ $total -le 64 ]] || { echo "gpu_check: .whl/ is over 64 MiB: remove the wheels not listed by --wheels" >&2; exit 1; }
    exit 0
    ;;
esac

version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if compgen -G ".whl/*.whl" > /dev/null && [[ $version == 3.12 ]]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  compgen -G ".whl/*.whl" > /dev/null && echo "gpu_check: .whl/ holds CPython 3.12 wheels, $PYTHON is $version: not installed"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# a section stuck in a collective must not eat the lease: the whole run is bounded
exec timeout --kill-after=10 "$BUDGET_S" "$PYTHON" scripts/gpu_check.py "$@"
