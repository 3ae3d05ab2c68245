#!/usr/bin/env bash
# Run the test suite in .venv, in two phases (tests/process_guard.py says why and how a test is split):
#   1. the tests that start no processes, on $MEGARL_TEST_WORKERS pytest-xdist workers (default 2);
#   2. the heavy ones (Ray, vLLM, torchrun, subprocesses, Slurm), whole modules per worker, on
#      $MEGARL_TEST_HEAVY_WORKERS workers (default 2; 0 runs them one at a time in one process).
# The arguments go to both phases; a marker expression (-m EXPR) is combined with each phase's own.
# Fails when either phase fails, or when neither collected a test (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=disabled
# Bytecode caching on, whatever the machine's default: the suite starts about a thousand Python processes, and
# without __pycache__ each compiles the megarl and test modules it imports again (measured: 0.4 CPU-s per trainer
# or engine process, and 19.5 -> 12 CPU-s per pytest collection, of which there are four).
unset PYTHONDONTWRITEBYTECODE

args=() mark="" exitfirst=0
while [ $# -gt 0 ]; do  # pytest keeps the last -m; so does this
    case "$1" in
        -m) mark="${2:-}"; shift 2 || shift ;;
        -m*) mark="${1#-m}"; shift ;;
        *) case "$1" in -x|--exitfirst) exitfirst=1 ;; esac
           args+=("$1"); shift ;;
    esac
done
within() { if [ -n "$mark" ]; then echo "($mark) and $1"; else echo "$1"; fi; }

echo "run_tests: phase 1 of 2, the tests that start no processes, on ${MEGARL_TEST_WORKERS:-2} workers"
.venv/bin/python -m pytest -n "${MEGARL_TEST_WORKERS:-2}" --dist loadfile -m "$(within "not heavy")" "${args[@]}"
light=$?
heavy=5
if [ "$exitfirst" -eq 1 ] && [ "$light" -ne 0 ] && [ "$light" -ne 5 ]; then
    echo "run_tests: phase 1 failed and -x was given; phase 2 (heavy tests) skipped" >&2
else
    echo "run_tests: phase 2 of 2, the heavy tests (they start processes), on ${MEGARL_TEST_HEAVY_WORKERS:-2} workers"
    # --no-loadscope-reorder: xdist hands out the modules in the order tests/module_order.py sets, slowest first
    .venv/bin/python -m pytest -n "${MEGARL_TEST_HEAVY_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
        -m "$(within heavy)" "${args[@]}"
    heavy=$?
fi

if [ "$light" -eq 5 ] && [ "$heavy" -eq 5 ]; then
    echo "run_tests: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
for rc in "$light" "$heavy"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        echo "run_tests: failed (phase 1 exit code $light, phase 2 exit code $heavy)" >&2
        exit "$rc"
    fi
done
exit 0
