#!/usr/bin/env bash
# Run the test suite: bootstrap the venv, then pytest on tests/ (and the notebooks, with nbmake,
# when there are any).  Arguments pass through to pytest; if any of them names a path, only the
# given paths run (so `scripts/test.sh tests/planner -x` does what it says).  A full run (no paths)
# records its wall time and pass/fail/skip counts in benchmarks/results/test_suite.json.
#
# Two pytest-xdist workers run side by side (TEST_WORKERS=N to change, 0 for one process): one
# takes the tests marked `distributed`, one after the other (their ranks mostly wait on each
# other and on deadlines), the other every other file; a free worker takes the next file
# (tests/conftest.py).  Each worker and each rank runs torch on one thread, so two cores are not
# oversubscribed.  Passing -n, --dist, -p no:xdist or --pdb yourself leaves the choice to you.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh

explicit_paths=0
own_workers=0
for arg in "$@"; do
    case "$arg" in
        -n|-n*|--numprocesses*|--dist*|no:xdist|--pdb|--trace) own_workers=1 ;;
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

workers=()
if [ "$own_workers" -eq 0 ] && [ "${TEST_WORKERS:-2}" -gt 0 ]; then
    if .venv/bin/python -c 'import xdist' 2>/dev/null; then
        workers=(-n "${TEST_WORKERS:-2}")
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    else
        echo "test.sh: pytest-xdist is not installed (dev extra); running in one process" >&2
    fi
fi

SECONDS=0
set +e
.venv/bin/python -m pytest -q "${workers[@]}" "${targets[@]}" "${record[@]}" "$@"
rc=$?  # pytest's own exit code is the script's: 5 (no tests collected) fails on purpose
set -e
if [ -n "$junit" ]; then
    wall=$SECONDS
    .venv/bin/python scripts/record_timing.py tests --wall-s "$wall" --rc "$rc" \
        --out benchmarks/results/test_suite.json --junit "$junit" --args="${workers[*]}${*:+ $*}" || true
    rm -f "$junit"
fi
exit "$rc"
