"""Run a worker script on N processes for the distributed tests, always with a deadline.

``run_torchrun`` launches ``torchrun --standalone --nproc_per_node N`` (the way users launch) and
returns the combined output and exit code.  ``run_ranks`` starts the N ranks itself (the same
environment variables torchrun sets) and returns each rank's own exit code and output; the
failure tests need that, because torchrun kills the surviving ranks as soon as one dies, which
would hide whether they would have reported the failure themselves.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
PYTHON = Path(sys.executable)
TORCHRUN = PYTHON.parent / "torchrun"


@dataclass
class LaunchResult:
    returncode: int
    output: str
    elapsed_s: float
    timed_out: bool


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_torchrun(script: str, nproc: int, args: list[str] = (), timeout_s: float = 180,
                 torchrun_args: list[str] = ()) -> LaunchResult:
    """``torchrun_args``: further launcher flags (e.g. ``--max-restarts 1``)."""
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
           str(WORKERS / script), *args]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout_s)
        return LaunchResult(p.returncode, p.stdout, time.time() - t0, False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return LaunchResult(-9, out, time.time() - t0, True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, nproc: int, args: list[str] = (), timeout_s: float = 60,
              agent_store: bool = False) -> list[LaunchResult]:
    """Start ``nproc`` ranks directly; kill any still running after ``timeout_s``.

    Each result's ``elapsed_s`` is when that rank exited (one reader thread per rank), so a rank
    that reported an error but then hung on exit shows up as slow or timed out.  ``agent_store``:
    the key-value store lives in this process, as torchrun's agent hosts it, not in rank 0 (which
    may exit first).
    """
    import threading

    port = _free_port()
    store = _agent_store(port) if agent_store else None
    t0 = time.time()
    results: list[LaunchResult | None] = [None] * nproc

    def run(r: int) -> None:
        env = _env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        if store is not None:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        p = subprocess.Popen([str(PYTHON), str(WORKERS / script), *args], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = p.communicate(timeout=timeout_s)
            results[r] = LaunchResult(p.returncode, out, time.time() - t0, False)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            results[r] = LaunchResult(-9, out, time.time() - t0, True)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(nproc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del store
    return results


def _agent_store(port: int):
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=300))


def check_cases(result: LaunchResult, nproc: int, cases, all_ok: str = "ALL OK") -> None:
    """Assert a worker launch ended in time with exit code 0, every one of the ``nproc`` ranks
    printed ``CASE <name> OK`` for each of ``cases``, and each printed ``all_ok`` once."""
    assert not result.timed_out, f"launch timed out after {result.elapsed_s:.0f}s:\n{result.output[-4000:]}"
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.output[-6000:]}"
    for case in cases:
        ranks = set(re.findall(rf"\[rank (\d+)\] CASE {re.escape(case)} OK", result.output))
        assert ranks == {str(r) for r in range(nproc)}, f"case {case} passed on ranks {sorted(ranks)}"
    assert result.output.count(all_ok) == nproc
