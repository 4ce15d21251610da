#!/usr/bin/env bash
# The test command: set up .venv (CPU torch first), check format and lint, run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# DeepSpeed's CPU comm op (deepspeed_shm_comm) is JIT-built by the first DeepSpeed process, about 40 s;
# its build flags name this venv's paths, so checkouts sharing ~/.cache/torch_extensions rebuild each
# other's: one cache per venv, built once
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
# ... and by one ninja: torch's JIT build runs the first `ninja` on PATH, and a build last made by another
# ninja version (the venv's pip one vs a system one) is rebuilt from scratch, about 40 s each time a
# test process sees the other PATH (the bench test prepends the venv's bin): the venv's, everywhere
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
