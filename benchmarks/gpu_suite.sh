#!/usr/bin/env bash
# Every GPU-side check in one go, on one CUDA GPU, from the repository root:
#   bash benchmarks/gpu_suite.sh [OUTDIR]      (default OUTDIR: $OUT, else benchmarks/results)
# 1. tests/gpu (CUDA attention backends vs SDPA, engine vs unsplit HF model)
# 2. profile the Llama-3.2-1B layer  -> OUTDIR/llama3.2-1b.profile.json (+ .rows.json)
# 3. single-GPU benchmark (HF vs HF+ckpt vs EPP, long-tailed batch) with that profile
# 4. memory-model check (predicted vs measured peak) with the default and the measured profile
# Its wall time has not been measured yet; run the steps separately (SUITE_STEPS="1 2") where a
# call has a time limit.  The first failing step stops the suite with its exit status (set -e
# with pipefail: a failure before `tee` counts), so a green run means every step passed.
set -euo pipefail
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
  echo "== gpu_suite step $s" | tee -a "$OUTDIR/suite.log"
  case "$s" in
    1) $PY -m pytest -q -rs tests/gpu 2>&1 | tee -a "$OUTDIR/suite.log" ;;
    2) $PY -m infinipipe_hf.profile --model "$CFG" --out "$PROFILE" \
         --lengths 512,1024,2048,4096,8192,16384,32768 --head-tokens 1024,2048,4096 \
         --slice-attention 1024:8192,4096:32768 2>&1 | tee -a "$OUTDIR/suite.log" ;;
    3) prof=()
       if [ -f "$PROFILE" ]; then prof=(--profile "$PROFILE"); fi
       $PY benchmarks/single_gpu.py --out "$OUTDIR/single_gpu.json" "${prof[@]}" 2>&1 | tee -a "$OUTDIR/suite.log" ;;
    4) $PY benchmarks/memory_model_check.py --out "$OUTDIR/memory_model_check_default.json" 2>&1 \
         | tee -a "$OUTDIR/suite.log"
       if [ -f "$PROFILE" ]; then
         $PY benchmarks/memory_model_check.py --profile "$PROFILE" \
           --out "$OUTDIR/memory_model_check_profiled.json" 2>&1 | tee -a "$OUTDIR/suite.log"
       fi ;;
    *) echo "gpu_suite: unknown step '$s' in SUITE_STEPS (use 1 2 3 4)" >&2; exit 2 ;;
  esac
done
echo "gpu_suite: every step passed" | tee -a "$OUTDIR/suite.log"
