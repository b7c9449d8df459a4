#!/usr/bin/env bash
# Run the test suite: bootstrap the venv, then pytest on tests/ (and the notebooks, with nbmake,
# when there are any).  Arguments pass through to pytest; if any of them names a path, only the
# given paths run (so `scripts/test.sh tests/planner -x` does what it says).  A full run (no paths)
# records its wall time and pass/fail/skip counts in benchmarks/results/test_suite.json.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh

explicit_paths=0
for arg in "$@"; do
    case "$arg" in
        -*) ;;
        *) if [ -e "${arg%%::*}" ]; then explicit_paths=1; fi ;;
    esac
done

targets=()
record=()
junit=""
if [ "$explicit_paths" -eq 0 ]; then
    targets=(tests)
    shopt -s nullglob
    notebooks=(notebooks/*.ipynb)
    shopt -u nullglob
    if [ "${#notebooks[@]}" -gt 0 ]; then
        targets+=(--nbmake "${notebooks[@]}")
    fi
    junit="$(mktemp -t infinipipe-junit-XXXXXX.xml)"
    record=(--junitxml "$junit")
fi

SECONDS=0
set +e
.venv/bin/python -m pytest -q "${targets[@]}" "${record[@]}" "$@"
rc=$?  # pytest's own exit code is the script's: 5 (no tests collected) fails on purpose
set -e
if [ -n "$junit" ]; then
    wall=$SECONDS
    .venv/bin/python scripts/record_timing.py tests --wall-s "$wall" --rc "$rc" \
        --out benchmarks/results/test_suite.json --junit "$junit" --args="$*" || true
    rm -f "$junit"
fi
exit "$rc"
