#!/usr/bin/env bash
# Every GPU-side check of issue 6 in one go, on one CUDA GPU, from the repository root:
#   bash benchmarks/gpu_suite.sh [OUTDIR]      (default OUTDIR: $OUT, else benchmarks/results)
# 1. tests/gpu (CUDA attention backends vs SDPA, engine vs unsplit HF model)
# 2. profile the Llama-3.2-1B layer  -> OUTDIR/llama3.2-1b.profile.json (+ .rows.json)
# 3. single-GPU benchmark (HF vs HF+ckpt vs EPP, long-tailed batch) with that profile
# 4. memory-model check (predicted vs measured peak) with the default and the measured profile
# Expected wall time on one H100: roughly 10-15 minutes; run the steps separately
# (SUITE_STEPS="1 2") where a call is limited to 10 minutes.
set -uo pipefail
OUTDIR="${1:-${OUT:-benchmarks/results}}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
STEPS="${SUITE_STEPS:-1 2 3 4}"
CFG=infinipipe_hf/models/configs/llama3.2-1b.json
PROFILE="$OUTDIR/llama3.2-1b.profile.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUTDIR/suite.log"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUTDIR/suite.log"
for s in $STEPS; do
  case "$s" in
    1) $PY -m pytest -q -rs tests/gpu 2>&1 | tee -a "$OUTDIR/suite.log" ;;
    2) $PY -m infinipipe_hf.profile --model "$CFG" --out "$PROFILE" \
         --lengths 512,1024,2048,4096,8192,16384,32768 --head-tokens 1024,2048,4096 \
         --slice-attention 1024:8192,4096:32768 2>&1 | tee -a "$OUTDIR/suite.log" ;;
    3) prof=(); [ -f "$PROFILE" ] && prof=(--profile "$PROFILE")
       $PY benchmarks/single_gpu.py --out "$OUTDIR/single_gpu.json" "${prof[@]}" 2>&1 | tee -a "$OUTDIR/suite.log" ;;
    4) $PY benchmarks/memory_model_check.py --out "$OUTDIR/memory_model_check_default.json" 2>&1 \
         | tee -a "$OUTDIR/suite.log"
       [ -f "$PROFILE" ] && $PY benchmarks/memory_model_check.py --profile "$PROFILE" \
         --out "$OUTDIR/memory_model_check_profiled.json" 2>&1 | tee -a "$OUTDIR/suite.log" ;;
  esac
done
