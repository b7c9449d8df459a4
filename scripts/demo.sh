#!/usr/bin/env bash
# Run the demo: bootstrap the venv, then `python -m infinipipe_hf.demo` with the given arguments.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh
exec .venv/bin/python -m infinipipe_hf.demo "$@"
