#!/usr/bin/env bash
# 8 GPUs on one node: pp 1 x sp 8.  One stage holds the whole model; every unit's tokens are split
# over the 8 GPUs and attention runs head-sharded (Ulysses all-to-alls over NVLink).  For long
# sequences on a model that fits one GPU.  sp 8 needs at least 8 attention heads (uneven head
# counts are fine: SmolLM2-135M's 9 heads run 1 or 2 per GPU).
# Usage: LAUNCHER=accelerate|torchrun MODEL=path recipes/gpu_8_pp1_sp8.sh [extra flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf installed
ARGS=(--model "${MODEL:-smollm2}" --corpus stdlib --max_docs 4000 --eval_docs 32 --pp_degree 1
      --sp_degree 8 --tokens_per_step 131072 --max_steps 500 --learning_rate 2e-5 --bf16
      --logging_steps 10 --save_steps 250 --output_dir "${OUTPUT_DIR:-runs/gpu_8_pp1_sp8}" --report_to none)
case "${LAUNCHER:-accelerate}" in
  accelerate) "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/gpu_8.yaml recipes/train.py "${ARGS[@]}" "$@" ;;
  torchrun)   "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 8 recipes/train.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be accelerate or torchrun" >&2; exit 2 ;;
esac
