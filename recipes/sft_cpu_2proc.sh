#!/usr/bin/env bash
# SFT of SmolLM2-135M-Instruct (offline GGUF) on 2 CPU processes (gloo), pp 2, assistant-only loss
# on conversational data.  Usage: LAUNCHER=torchrun|accelerate recipes/sft_cpu_2proc.sh [extra flags]
# Run here with torchrun (tests/distributed/test_sft_recipe.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf[sft] installed
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ARGS=(--pp_degree 2 --tokens_per_step 1024 --max_length 512 --assistant_only_loss
      --num_examples 48 --eval_examples 8 --max_steps 4 --learning_rate 2e-5 --bf16 False
      --logging_steps 1 --save_strategy no --output_dir "${OUTPUT_DIR:-runs/sft_cpu_2proc}" --report_to none
      --use_cpu)
case "${LAUNCHER:-torchrun}" in
  torchrun)   "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 recipes/sft_smollm2.py "${ARGS[@]}" "$@" ;;
  accelerate) ACCELERATE_USE_CPU=true "$PYTHON" -m accelerate.commands.launch --multi_gpu --num_processes 2 \
                --main_process_port "${PORT:-29513}" recipes/sft_smollm2.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be torchrun or accelerate" >&2; exit 2 ;;
esac
