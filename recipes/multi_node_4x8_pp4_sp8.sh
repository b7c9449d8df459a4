#!/usr/bin/env bash
# The paper's layout, 4 nodes x 8 GPUs: sp 8 inside each node (the Ulysses all-to-alls stay on
# NVLink), pp 4 across nodes (one stage per node; only hidden states of token shards cross the
# network, SP rank i of node s to SP rank i of node s + 1).  For LLaMA-7B..30B-sized models pass
# MODEL=<local HF directory>; LLaMA-30B's 52 heads run 6 or 7 per GPU at sp 8.
# Run on every node: NODE_RANK=0..3 MASTER_ADDR=<node 0 address> recipes/multi_node_4x8_pp4_sp8.sh
# Checkpoints need a filesystem all nodes see.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"  # the environment with infinipipe_hf installed
: "${NODE_RANK:?set NODE_RANK to 0..3}" "${MASTER_ADDR:?set MASTER_ADDR to node 0}"
PORT="${MASTER_PORT:-29500}"
ARGS=(--model "${MODEL:-smollm2}" --corpus stdlib --max_docs 8000 --eval_docs 32 --pp_degree 4
      --sp_degree 8 --tokens_per_step 262144 --max_steps 500 --learning_rate 2e-5 --bf16
      --logging_steps 10 --save_steps 250 --output_dir "${OUTPUT_DIR:-runs/multi_node_4x8_pp4_sp8}"
      --report_to none)
case "${LAUNCHER:-accelerate}" in
  accelerate) "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/multi_node_4x8.yaml \
                --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR" --main_process_port "$PORT" \
                recipes/train.py "${ARGS[@]}" "$@" ;;
  torchrun)   "$PYTHON" -m torch.distributed.run --nnodes 4 --nproc_per_node 8 --node_rank "$NODE_RANK" \
                --master_addr "$MASTER_ADDR" --master_port "$PORT" recipes/train.py "${ARGS[@]}" "$@" ;;
  *) echo "LAUNCHER must be accelerate or torchrun" >&2; exit 2 ;;
esac
