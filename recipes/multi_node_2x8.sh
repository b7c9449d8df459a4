#!/usr/bin/env bash
# 2 nodes x 8 GPUs: pp 8 x dp 2 (each pipeline inside one node; the DP all-reduce crosses nodes).
# Run on both nodes: NODE_RANK=0|1 MASTER_ADDR=<node 0 address> recipes/multi_node_2x8.sh
# Checkpoints need a filesystem both nodes see (rank 0 writes the index of all stages' shards).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf installed
: "${NODE_RANK:?set NODE_RANK to 0 or 1}" "${MASTER_ADDR:?set MASTER_ADDR to node 0}"
PORT="${MASTER_PORT:-29500}"
ARGS=(--model "${MODEL:-smollm2}" --corpus stdlib --max_docs 8000 --eval_docs 32 --pp_degree 8
      --tokens_per_step 262144 --max_steps 500 --learning_rate 2e-5 --bf16 --logging_steps 10
      --save_steps 250 --output_dir "${OUTPUT_DIR:-runs/multi_node_2x8}" --report_to none)
case "${LAUNCHER:-accelerate}" in
  accelerate) "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/multi_node_2x8.yaml \
                --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR" --main_process_port "$PORT" \
                recipes/train.py "${ARGS[@]}" "$@" ;;
  torchrun)   "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc_per_node 8 --node_rank "$NODE_RANK" \
                --master_addr "$MASTER_ADDR" --master_port "$PORT" recipes/train.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be accelerate or torchrun" >&2; exit 2 ;;
esac
