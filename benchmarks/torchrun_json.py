"""Run a gloo worker under ``torchrun`` on this machine and read the JSON it writes.

The memory benchmarks measure in ``tests/distributed/workers/`` (the same code the tests run);
the worker takes the output path as its one argument.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_json_worker(worker: Path, nproc: int = 2, timeout_s: int = 900) -> dict:
    """``worker``'s JSON after ``torchrun --standalone --nproc_per_node nproc worker OUT``; exits
    with the worker's output tail when it fails."""
    torchrun = Path(sys.executable).parent / "torchrun"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        p = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(nproc), str(worker), str(raw)],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout_s)
        if p.returncode != 0:
            raise SystemExit(p.stdout[-4000:])
        return json.loads(raw.read_text())
