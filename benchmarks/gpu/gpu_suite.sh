#!/usr/bin/env bash
# Every GPU check of the project in one run on one CUDA GPU, most valuable first, sized for a
# short lease (about 6 minutes on an H100, at most 8.8 with every step at its limit):
#   bash benchmarks/gpu/gpu_suite.sh [--dry-run] [OUTDIR]     (OUTDIR: $OUT if set, else out/gpu_suite)
#   SUITE_STEPS="2 5" bash benchmarks/gpu/gpu_suite.sh        (rerun only some steps)
# 1 tests/gpu                  -> gpu_suite.json's gpu_tests: pass/fail per test
# 2 profile 1B and 7B layers   -> gpu_profile.json        uncalibrated fits vs the shipped layer fit;
#                                 then the 1B shape's attention backends per unit kind (its routing
#                                 table, profile.attention_backends, <= 15 s, timed after the profile
#                                 is saved so that a slow FlexAttention compile cannot lose it)
# 3 memory model, 4 plans      -> memory_model_check.json predicted / measured peak
# 4 single GPU, 8K-128K        -> single_gpu.json         EPP vs HF (+ checkpointing)
# 5 simulator vs real          -> gpu_sim_vs_real.json    one plan, per action, simulated with the
#                                 stage-depth profile fitted first (stages of 1 and 3 layers: per-layer
#                                 and per-unit stage costs; gpu_profile.json's stage_depth_profile)
# 6 demo in bf16               -> gpu_demo.json           loss curve beside CPU float32
# 7 host tier, longest length  -> offload_reach_gpu.json  predicted / measured device and host peak,
#                                 step time; tokens/s beside the run without the host tier
#                                 (Llama-3.2-1B shape, optimizer states on the host, the machine's
#                                 host memory, the device budget capped at 10 GiB so that the
#                                 longest length, about 64K, runs two steps inside its 90 s)
# Each step runs under `set -euo pipefail` with its own time limit, writes its JSON as soon as it
# has it, and a failing step does not stop the next; gpu_suite.json records every step's status
# and gpu_suite.log everything printed (8 files in all: what the device tool brings back; the GPU
# tests' results go into gpu_suite.json for that reason).
# --dry-run runs every step's Python on the CPU with tiny shapes (tests/benchmarks/gpu/test_gpu_suite_script.py
# runs it), so a typo cannot waste a lease. Needs only what the lent machine has (torch, transformers,
# scipy, pytest); the fitted profiles live in a scratch folder, not OUTDIR.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUTDIR="$(mkdir -p "${1:-${OUT:-out/gpu_suite}}" && cd "${1:-${OUT:-out/gpu_suite}}" && pwd)"
WORK="$(mktemp -d -t gpu_suite.XXXXXX)"
export OUTDIR WORK DRY PY="${PYTHON:-python3}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Units of many sizes fragment the caching allocator's fixed segments; HF and EPP alike run with
# expandable segments unless the caller sets its own configuration.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}"
LOG="$OUTDIR/gpu_suite.log"
export SUITE="$OUTDIR/gpu_suite.json"
STEPS="${SUITE_STEPS:-1 2 3 4 5 6 7}"
if [ "$DRY" = 1 ]; then
  export DEV="--tiny --device cpu --dtype fp32" PROFILED=tiny
  LIMITS=(0 240 240 240 240 240 240 240)
else
  export DEV="" PROFILED=llama3.2-1b
  LIMITS=(0 80 60 55 150 60 35 90)
fi
export PROFILE="$WORK/$PROFILED.profile.json"
prof_arg() { if [ -f "$PROFILE" ]; then echo "--profile $PROFILE"; fi; }
export -f prof_arg

step_1() {  # the CUDA attention backends, keep_attn's flash pair, the engine on CUDA
  local rc=0
  $PY -m pytest -q -rs -p no:cacheprovider --timeout 60 tests/gpu --junitxml "$WORK/gpu_tests.xml" || rc=$?
  $PY -m benchmarks.gpu.gpu_suite_report tests "$WORK/gpu_tests.xml" "$SUITE"
  return $rc
}
step_2() {  # the profiler on two layer shapes (its attention-backend table too); profiles saved in WORK for steps 3-5
  if [ "$DRY" = 1 ]; then
    $PY -m benchmarks.gpu.gpu_profile $DEV --lengths 32,64,128 --head-tokens 32,64 --slice-attention 16:48 \
      --repeat 1 --warmup 0 --profile-dir "$WORK" --out "$OUTDIR/gpu_profile.json"
  else
    $PY -m benchmarks.gpu.gpu_profile --models llama3.2-1b,llama2-7b --profile-dir "$WORK" \
      --out "$OUTDIR/gpu_profile.json"
  fi
}
step_3() {  # slices with context, packs, a hybrid, checkpoint levels under a tight budget
  local cases="24576:4:none,8192+2048x12:1:none,16384+9000+1024x8:3:none,65536:4:adaptive:30"
  if [ "$DRY" = 1 ]; then cases="64:4:none,48+16x6:1:none,96+50+8x4:3:none,128:4:adaptive"; fi
  $PY -m benchmarks.gpu.memory_model_check $DEV --cases "$cases" $(prof_arg) --steps 2 --warmup 1 \
    --out "$OUTDIR/memory_model_check.json"
}
step_4() {  # EPP vs HF with and without checkpointing; the longest first, EPP first at each length
  local sizes=(--lengths 131072,65536,32768,8192)
  if [ "$DRY" = 1 ]; then
    sizes=(--lengths 48,96 --longtail-tokens 120 --longtail-max-len 4200 --pack-tokens 64)
  fi
  $PY -m benchmarks.gpu.single_gpu $DEV "${sizes[@]}" --sections single,longtail \
    --methods epp,hf_ckpt,hf,hf_packed_ckpt,epp_same,epp_compiled --steps 2 --warmup 1 $(prof_arg) --no-plot \
    --out "$OUTDIR/single_gpu.json"
}
step_5() {  # the stage-depth profile on step 2's; one plan that slices, packs and checkpoints, simulated with it
  local case=() fit=(--max-blocks 16 --repeat 3) limit=25 base=() prof=()
  local stage="$WORK/$PROFILED.stage.profile.json"
  if [ "$DRY" = 1 ]; then case=(--case "96+32+16x2+8x4:4:adaptive" --steps 1); fit=(--max-blocks 16 --repeat 1 --warmup 0); limit=200; fi
  if [ -f "$PROFILE" ]; then base=(--base-profile "$PROFILE"); fi
  timeout "$limit" $PY -m benchmarks.gpu.gpu_unit_profile $DEV "${fit[@]}" "${base[@]}" --depths 1,3 \
    --profile-out "$stage" --out "$OUTDIR/gpu_profile.json" --out-key stage_depth_profile \
    || echo "gpu_suite: the stage-depth fit failed; simulating with step 2's profile"
  if [ -f "$stage" ]; then prof=(--profile "$stage"); elif [ -f "$PROFILE" ]; then prof=(--profile "$PROFILE"); fi
  $PY -m benchmarks.gpu.gpu_sim_vs_real $DEV "${case[@]}" "${prof[@]}" --out "$OUTDIR/gpu_sim_vs_real.json"
}
step_6() {  # the demo's run as one bf16 EPPTrainer job, beside the committed CPU float32 run
  if [ "$DRY" = 1 ]; then
    $PY -m benchmarks.gpu.gpu_demo $DEV --steps 2 --out "$OUTDIR/gpu_demo.json"
  else
    $PY -m benchmarks.gpu.gpu_demo --device cuda --dtype bf16 --out "$OUTDIR/gpu_demo.json"
  fi
}
step_7() {  # the longest sequence with optimizer states, inputs and K/V in host memory, and without
  if [ "$DRY" = 1 ]; then
    $PY -m benchmarks.gpu.offload_reach_gpu $DEV --out "$OUTDIR/offload_reach_gpu.json"
  else
    $PY -m benchmarks.gpu.offload_reach_gpu --state-offload optimizer --memory-budget-gib 10 $(prof_arg) \
      --out "$OUTDIR/offload_reach_gpu.json"
  fi
}
NAMES=(none tests_gpu profile memory_model single_gpu sim_vs_real demo_bf16 offload_reach)
export -f step_1 step_2 step_3 step_4 step_5 step_6 step_7

{ echo "gpu_suite: $(date -u +%FT%TZ) dry_run=$DRY steps='$STEPS' out=$OUTDIR"
  $PY -m benchmarks.gpu.gpu_suite_report env "$SUITE"; } 2>&1 | tee -a "$LOG"
failed=0
for s in $STEPS; do
  if ! [[ "$s" =~ ^[1-7]$ ]]; then
    echo "gpu_suite: unknown step '$s' in SUITE_STEPS (use 1 to 7)" | tee -a "$LOG" >&2
    exit 2
  fi
  echo "== step $s ${NAMES[$s]} (limit ${LIMITS[$s]} s)" | tee -a "$LOG"
  start=$SECONDS
  timeout --kill-after=10 "${LIMITS[$s]}" bash -c "set -euo pipefail; step_$s" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  $PY -m benchmarks.gpu.gpu_suite_report step "$SUITE" "$s" "${NAMES[$s]}" "$rc" "$((SECONDS - start))" \
    "${LIMITS[$s]}"
  echo "== step $s ${NAMES[$s]}: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
  if [ "$rc" -ne 0 ]; then failed=$((failed + 1)); fi
done
rm -rf "$WORK"
echo "gpu_suite: $failed step(s) failed" | tee -a "$LOG"
[ "$failed" -eq 0 ]
