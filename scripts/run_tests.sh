#!/usr/bin/env bash
# Run the test suite in .venv, in one pytest session on $MEGARL_TEST_WORKERS pytest-xdist workers (default 2;
# 0 runs it in this one process), whole modules per worker: a module's shared cluster or engine stays with it.
# The modules whose tests start no processes go first, then the heavy ones (Ray, vLLM, torchrun, subprocesses,
# Slurm): tests/process_guard.py says how a test is split, and keeps a light test from starting a process.
# The arguments go to pytest (-m EXPR selects by marker, as pytest's own).
# Fails when pytest fails, or when it collected no test (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=disabled
# Bytecode caching on, whatever the machine's default: the suite starts about a thousand Python processes, and
# without __pycache__ each compiles the megarl and test modules it imports again (measured: 0.4 CPU-s per trainer
# or engine process, and 19.5 -> 12 CPU-s per pytest collection).
unset PYTHONDONTWRITEBYTECODE

workers="${MEGARL_TEST_WORKERS:-2}"
echo "run_tests: one session on ${workers} workers, the tests that start no processes first, then the heavy ones"
# --no-loadscope-reorder: xdist keeps the order tests/process_guard.py gives the modules
.venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
