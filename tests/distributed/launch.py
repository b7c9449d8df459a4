"""Run a worker script on N processes for the distributed tests, always with a deadline.

``run_torchrun`` launches ``torchrun --standalone --nproc_per_node N`` (the way users launch) and
returns the combined output and exit code.  ``run_ranks`` starts the N ranks itself (the same
environment variables torchrun sets) and returns each rank's own exit code and output; the
failure tests need that, because torchrun kills the surviving ranks as soon as one dies, which
would hide whether they would have reported the failure themselves.  ``merged_launch`` runs
several workers of one world size in one torchrun launch (``workers/suites.py``) and
``split_suites`` gives each its own part of the output, judged as a launch of its own would be.
"""
from __future__ import annotations

import json
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


# Worker runs that share one launch per world size (``workers/suites.py``): name -> (world size,
# worker script, its arguments, its own launch's time limit in seconds).  In the arguments,
# ``{refs}`` stands for the trainer references' folder and ``{out}`` for a fresh folder of its own
# (``conftest.py`` fills them in).
SUITES = {
    "exact_pp2": (2, "exact_grads.py", ["pp2"], 400),
    "sp2_exact": (2, "sp_exact.py", ["sp2"], 400),
    "sp2_memory": (2, "sp_memory.py", [], 400),
    "sp2_memory_model": (2, "sp_memory_model.py", [], 400),
    "rounds_memory": (2, "sp_rounds_memory.py", [], 400),
    "invalid_plans": (2, "invalid_plans.py", [], 240),
    "trainer_pp2": (2, "trainer_cases.py", ["pp2", "{refs}", "{out}", "default"], 200),
    "trainer_auto": (2, "trainer_auto.py", ["{refs}", "{out}"], 360),
    "offload_pp2": (2, "offload_exact.py", ["pp2", "{out}"], 200),
    "offload_sp2": (2, "offload_exact.py", ["sp2", "{out}"], 200),
    "exact_world4": (4, "exact_grads.py", ["world4"], 600),
    "sp_exact_world4": (4, "sp_exact.py", ["world4"], 600),
    "rounds_world4": (4, "sp_rounds.py", [], 600),
    "kv_shards_world4": (4, "sp_kv_shards.py", [], 300),
    "sharded_grads": (4, "sharded_grads.py", [], 480),
    "sharded_sp_groups": (4, "sharded_sp_groups.py", [], 280),
    "trainer_world4": (4, "trainer_cases.py", ["world4", "{refs}", "{out}", "default"], 260),
    "trainer_sharded": (4, "trainer_sharded.py", ["{refs}", "{out}", "default"], 360),
    "trainer_sp": (4, "trainer_sp.py", ["{refs}", "{out}", "default"], 360),
}
MERGED_LIMIT_S = 840.0
"""A merged launch's time limit: its suites' own limits added up, at most this (tests that read a
merged launch allow 900 s: the first of them waits for the whole launch)."""


def merged_launch(args: dict[str, list[str]]) -> dict[str, LaunchResult]:
    """Run the suites named by ``args`` (one world size; each with its filled-in arguments) in one
    launch; return each one's part of it."""
    names = list(args)
    sizes = {SUITES[n][0] for n in names}
    assert len(sizes) == 1, f"suites of several world sizes in one launch: {names}"
    spec = [[n, SUITES[n][1], args[n]] for n in names]
    limit = min(sum(SUITES[n][3] for n in names), MERGED_LIMIT_S)
    result = run_torchrun("suites.py", SUITES[names[0]][0], [json.dumps(spec)], timeout_s=limit)
    return split_suites(result, names, SUITES[names[0]][0])


def split_suites(result: LaunchResult, names: list[str], nproc: int) -> dict[str, LaunchResult]:
    """Each suite's output: from its first ``SUITE <name> START`` to the next suite's (every rank
    waits for the others between suites).  A suite's return code is 0 when all ``nproc`` ranks
    printed its ``END`` and the launch ended well or failed in another suite; otherwise the
    launch's.  A suite that never started gets the end of the launch's output, saying so."""
    starts = [result.output.find(f"] SUITE {n} START") for n in names]
    done = {n: len(re.findall(rf"\[rank \d+\] SUITE {re.escape(n)} END", result.output)) == nproc
            for n in names}
    parts = {}
    for i, name in enumerate(names):
        if starts[i] < 0:
            text = (f"suite {name} did not start: the launch stopped before it (exit code "
                    f"{result.returncode}); the end of its output:\n{result.output[-6000:]}")
            parts[name] = LaunchResult(result.returncode or 1, text, result.elapsed_s, result.timed_out)
            continue
        later = [s for s in starts[i + 1:] if s >= 0]
        text = result.output[result.output.rfind("\n", 0, starts[i]) + 1:later[0] if later else None]
        ok = done[name] and (result.returncode == 0 or not all(done.values()))
        code = 0 if ok else (result.returncode or 1)
        parts[name] = LaunchResult(code, text, result.elapsed_s, result.timed_out and not done[name])
    return parts


def check_cases(result: LaunchResult, nproc: int, cases, all_ok: str = "ALL OK") -> None:
    """Assert a worker launch ended in time with exit code 0, every one of the ``nproc`` ranks
    printed ``CASE <name> OK`` for each of ``cases``, and each printed ``all_ok`` once."""
    assert not result.timed_out, f"launch timed out after {result.elapsed_s:.0f}s:\n{result.output[-4000:]}"
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.output[-6000:]}"
    for case in cases:
        ranks = set(re.findall(rf"\[rank (\d+)\] CASE {re.escape(case)} OK", result.output))
        assert ranks == {str(r) for r in range(nproc)}, f"case {case} passed on ranks {sorted(ranks)}"
    assert result.output.count(all_ok) == nproc
