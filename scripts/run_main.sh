#!/usr/bin/env bash
# The main job: set up .venv, then a 4-process UPipe training run (ZeRO-3, sequence_parallel_size 4)
# through the real `deepspeed` launcher.  CPU by default (gloo, float32: most CPUs emulate bf16);
# on a GPU machine: NUM_PROCS=<gpus> UPIPE_DEVICE=gpu bash scripts/run_main.sh (keeps the config's bf16).
# Extra arguments go to examples/train_deepspeed.py (see --help there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
NUM_PROCS="${NUM_PROCS:-4}"
CONFIG="${CONFIG:-ds_configs/upipe_zero3.json}"
extra=()
if [ "${UPIPE_DEVICE:-cpu}" = "cpu" ]; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  extra=(--set bf16.enabled=false)
fi
exec .venv/bin/deepspeed --num_gpus "$NUM_PROCS" examples/train_deepspeed.py \
  --deepspeed_config "$CONFIG" "${extra[@]}" "$@"
