#!/usr/bin/env bash
# 8 GPUs on one node: pp 2 x sp 4.  Two stages of 4 GPUs each (GPUs 0-3 and 4-7); SP rank i of
# stage 0 sends its token shard to SP rank i of stage 1.
# Usage: LAUNCHER=accelerate|torchrun MODEL=path recipes/gpu_8_pp2_sp4.sh [extra flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf installed
ARGS=(--model "${MODEL:-smollm2}" --corpus stdlib --max_docs 4000 --eval_docs 32 --pp_degree 2
      --sp_degree 4 --tokens_per_step 131072 --max_steps 500 --learning_rate 2e-5 --bf16
      --logging_steps 10 --save_steps 250 --output_dir "${OUTPUT_DIR:-runs/gpu_8_pp2_sp4}" --report_to none)
case "${LAUNCHER:-accelerate}" in
  accelerate) "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/gpu_8.yaml recipes/train.py "${ARGS[@]}" "$@" ;;
  torchrun)   "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 8 recipes/train.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be accelerate or torchrun" >&2; exit 2 ;;
esac
