#!/usr/bin/env bash
# Run the demo: bootstrap the venv, then `python -m infinipipe_hf.demo` with the given arguments.
# The wall time (and the demo's losses) go to benchmarks/results/demo_timing.json (demo_timing_quick.json
# for --quick), so the README's demo figures have a file behind them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh

out="out/demo"
record="benchmarks/results/demo_timing.json"
prev=""
for arg in "$@"; do
    if [ "$prev" = "--out" ]; then out="$arg"; fi
    case "$arg" in
        --out=*) out="${arg#--out=}" ;;
        --quick) record="benchmarks/results/demo_timing_quick.json" ;;
    esac
    prev="$arg"
done

SECONDS=0
set +e
.venv/bin/python -m infinipipe_hf.demo "$@"
rc=$?
set -e
wall=$SECONDS
.venv/bin/python scripts/record_timing.py demo --wall-s "$wall" --rc "$rc" --out "$record" \
    --summary "$out/summary.json" --args="$*"
exit "$rc"
