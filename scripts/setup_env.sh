#!/usr/bin/env bash
# Create (or reuse) .venv with a CPU torch and ds_upipe installed in editable mode.
# The CPU torch goes in first: installing deepspeed/accelerate into an env without torch pulls a
# multi-GB CUDA build.  Set UPIPE_VENV to use another location, UPIPE_TORCH to pin another torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${UPIPE_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  TORCH_SPEC="${UPIPE_TORCH:-torch==2.13.0}"
  # On these machines pip's configured local wheel store serves the CPU build of torch==2.13.0.
  # Elsewhere, point pip at a CPU wheel index (PIP_INDEX_URL) before running this script.
  $PIP install -q "$TORCH_SPEC"
fi
$PIP install -q -e ".[test]"
echo "environment ready: $VENV"
