#!/usr/bin/env bash
# 4 CPU processes (gloo), pp 4 x dp 1, a tiny random Llama on Python's stdlib sources.
# Usage: LAUNCHER=accelerate|torchrun recipes/cpu_4proc.sh [extra EPPTrainingArguments flags]
# Tested on CPU with both launchers (see recipes/README.md); runs in about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf installed
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ARGS=(--model tiny --tiny_layers 8 --corpus stdlib --max_docs 40 --eval_docs 4
      --pp_degree 4 --tokens_per_step 1024 --max_steps 4 --learning_rate 1e-3
      --logging_steps 1 --save_steps 2 --output_dir "${OUTPUT_DIR:-runs/cpu_4proc}" --report_to none
      --use_cpu)
case "${LAUNCHER:-accelerate}" in
  accelerate) "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/cpu_4proc.yaml \
                --main_process_port "${PORT:-29511}" recipes/train.py "${ARGS[@]}" "$@" ;;
  torchrun)   "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 4 recipes/train.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be accelerate or torchrun" >&2; exit 2 ;;
esac
