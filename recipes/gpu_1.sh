#!/usr/bin/env bash
# One GPU, pp 1: SmolLM2-135M in bf16 on long-tailed stdlib sources (elastic units, adaptive
# checkpointing within the GPU's memory).  Not run in CI (no GPU there).
# Usage: LAUNCHER=accelerate|torchrun recipes/gpu_1.sh [extra flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf installed
ARGS=(--model smollm2 --corpus stdlib --max_docs 2000 --eval_docs 16 --pp_degree 1
      --tokens_per_step 32768 --max_steps 200 --learning_rate 2e-5 --bf16 --logging_steps 10
      --save_steps 100 --output_dir "${OUTPUT_DIR:-runs/gpu_1}" --report_to none)
case "${LAUNCHER:-accelerate}" in
  accelerate) "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/gpu_1.yaml recipes/train.py "${ARGS[@]}" "$@" ;;
  torchrun)   "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 recipes/train.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be accelerate or torchrun" >&2; exit 2 ;;
esac
