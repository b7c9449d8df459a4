#!/usr/bin/env bash
# Run the test suite: bootstrap the venv, then pytest on tests/ (and the notebooks, with nbmake,
# when there are any).  Arguments pass through to pytest; if any of them names a path, only the
# given paths run (so `scripts/test.sh tests/unit -x` does what it says).
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
if [ "$explicit_paths" -eq 0 ]; then
    targets=(tests)
    shopt -s nullglob
    notebooks=(notebooks/*.ipynb)
    shopt -u nullglob
    if [ "${#notebooks[@]}" -gt 0 ]; then
        targets+=(--nbmake "${notebooks[@]}")
    fi
fi

# pytest's own exit code is the script's: 5 (no tests collected) fails on purpose.
exec .venv/bin/python -m pytest -q "${targets[@]}" "$@"
