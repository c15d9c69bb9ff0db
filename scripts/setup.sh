#!/usr/bin/env bash
# Set up emotune in ./.venv: a virtual environment, PyTorch, and the project with its test extras.
# PyTorch: a ROCm or CUDA build already installed for this Python is kept (the venv sees it through
# --system-site-packages); never replaced by a CPU build. Otherwise `pip install torch==2.13.0`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

has_gpu_torch() {
  "$1" - <<'PY' 2>/dev/null
import sys, torch
sys.exit(0 if (getattr(torch.version, "hip", None) or getattr(torch.version, "cuda", None)) else 1)
PY
}

if [ ! -x .venv/bin/python ]; then
  if has_gpu_torch "$PYTHON"; then
    echo "setup: keeping the GPU build of torch that $PYTHON already has"
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
VENV_PY=.venv/bin/python
"$VENV_PY" -m pip install -q --upgrade pip
if "$VENV_PY" -c "import torch" 2>/dev/null; then
  echo "setup: torch $("$VENV_PY" -c 'import torch; print(torch.__version__)') already installed; keeping it"
else
  "$VENV_PY" -m pip install -q "torch==2.13.0"
fi
"$VENV_PY" -m pip install -q -e ".[test]"
echo "setup: done ($("$VENV_PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
