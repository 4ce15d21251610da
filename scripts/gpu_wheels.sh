#!/usr/bin/env bash
# Wheels the GPU acceptance machine lacks, for scripts/gpu_check.py there (run HERE, on a machine with
# network access and the project's venv).  The device image has Python 3.12, torch 2.11+cu130,
# transformers 5.17, accelerate 1.15 and peft, and no deepspeed, pydantic, hjson or flash-attn, and no
# network: so this puts into gpu_wheels/ (ignored by git) the cp312 manylinux / pure-Python wheels
#   deepspeed     built here as a py3-none-any wheel with DS_BUILD_OPS=0 (no CUDA ops compiled; UPipe
#                 uses none), at the version the venv holds (the tested one)
#   pydantic, pydantic-core (cp312 manylinux), annotated-types, typing-inspection, typing-extensions, hjson
#   transformers  at the tested (venv's) version: the image's 5.17 is older than what the HF patches
#                 were tested with
# at the versions installed in the venv, and checks they fit the 64 MiB a device call carries.
# On the device:  python3 -m pip install --no-index --no-deps gpu_wheels/*.whl && python3 scripts/gpu_check.py
# PY: the venv's python (default: this clone's .venv, what scripts/setup_env.sh makes).
# GPU_WHEELS_PLAN=1: print the python and the pinned versions, build nothing (tests/test_gpu_setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
OUT=${GPU_WHEELS:-gpu_wheels}
if [ ! -x "$PY" ]; then
  echo "gpu_wheels: no python at $PY: run scripts/setup_env.sh in this clone first, or set PY" >&2
  exit 1
fi

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

if [ -n "${GPU_WHEELS_PLAN:-}" ]; then
  echo "python: $PY"
  for pkg in deepspeed pydantic transformers; do echo "$pkg==$(version "$pkg")"; done
  exit 0
fi
rm -rf "$OUT" && mkdir -p "$OUT"

# deepspeed: its setup.py imports torch, so no build isolation (the venv's CPU torch is enough: no ops are built)
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$OUT" \
  "deepspeed==$(version deepspeed)"

binary=()
for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson transformers; do
  binary+=("$pkg==$(version "$pkg")")
done
"$PY" -m pip download --no-deps -q -d "$OUT" --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  "${binary[@]}"

ls -la "$OUT"
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: $(ls "$OUT"/*.whl | wc -l) wheels, $((total / 1024)) KiB"
if ((total > 60 * 1024 * 1024)); then
  echo "gpu_wheels: over 60 MiB, the device call carries 64 MiB in all" >&2
  exit 1
fi
