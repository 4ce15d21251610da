#!/usr/bin/env bash
# The test command: set up .venv (CPU torch first), check format and lint, run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
