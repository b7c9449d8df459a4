#!/usr/bin/env bash
# 4 CPU processes (gloo), pp 2 x sp 2: two pipeline stages, each run by two sequence-parallel ranks
# (every unit's tokens split over them, Ulysses attention), a tiny random Llama on stdlib sources.
# Usage: LAUNCHER=accelerate|torchrun recipes/cpu_4proc_pp2_sp2.sh [extra EPPTrainingArguments flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf installed
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ARGS=(--model tiny --tiny_layers 8 --corpus stdlib --max_docs 40 --eval_docs 4
      --pp_degree 2 --sp_degree 2 --tokens_per_step 1024 --max_steps 4 --learning_rate 1e-3
      --logging_steps 1 --save_steps 2 --output_dir "${OUTPUT_DIR:-runs/cpu_4proc_pp2_sp2}" --report_to none
      --use_cpu)
case "${LAUNCHER:-accelerate}" in
  accelerate) "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/cpu_4proc.yaml \
                --main_process_port "${PORT:-29512}" recipes/train.py "${ARGS[@]}" "$@" ;;
  torchrun)   "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 4 recipes/train.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be accelerate or torchrun" >&2; exit 2 ;;
esac
