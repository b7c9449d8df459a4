"""Run gloo ranks under ``torchrun`` on this machine, from the repository root.

Benchmark workers are modules (``torchrun ... -m benchmarks.workers.runtime_worker``), so they
import ``benchmarks`` and ``infinipipe_hf`` with no path edits of their own; the repository root is
the ranks' working directory and their ``PYTHONPATH``.  The memory benchmarks measure in
``tests/distributed/workers/`` (the same code the tests run): those are files, launched by path,
and take the output path as their one argument (:func:`run_json_worker`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from benchmarks.lib.paths import REPO

TORCHRUN = Path(sys.executable).parent / "torchrun"


def rank_env() -> dict[str, str]:
    """The ranks' environment: one thread each, the repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def torchrun(target: Sequence[str], nproc: int, timeout_s: float, *, check: bool = False,
             capture: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc TARGET...`` from the repository root, where
    ``target`` is ``["-m", "benchmarks.workers.X", *args]`` or ``[path, *args]``; output (stdout
    and stderr merged) captured unless ``capture`` is false."""
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", *map(str, target)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} if capture else {}
    return subprocess.run(cmd, cwd=REPO, env=rank_env(), timeout=timeout_s, check=check, **pipes)


def run_json_worker(worker: Path, nproc: int = 2, timeout_s: int = 900) -> dict:
    """``worker``'s JSON after ``torchrun --standalone --nproc_per_node nproc worker OUT``; exits
    with the worker's output tail when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.json"
        p = torchrun([worker, raw], nproc, timeout_s)
        if p.returncode != 0:
            raise SystemExit(p.stdout[-4000:])
        return json.loads(raw.read_text())
