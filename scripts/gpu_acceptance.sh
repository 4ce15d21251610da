#!/usr/bin/env bash
# The GPU acceptance in one device call (docs/gpu.md): install the carried wheels (scripts/gpu_wheels.sh,
# run beforehand on the CPU machine), then scripts/gpu_check.py; its JSON lands in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --no-index --no-deps -q gpu_wheels/*.whl 2>&1 | tail -3
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 470 python3 scripts/gpu_check.py "$@"
