"""Several worker scripts in one launch: process start-up and imports are most of a small
worker's time, so the tests of one world size share a launch (``launch.merged_launch``).

``suites.py SPEC``, SPEC a JSON list of ``[name, script, [args...]]``.  For each suite, every rank
prints ``[rank r] SUITE <name> START``, runs ``script`` as ``__main__`` with ``args`` as its
``sys.argv[1:]`` (exactly as a launch of its own would), waits for every other rank and prints
``[rank r] SUITE <name> END``.  One process group serves every suite: ``common.init`` starts it once
and a worker's ``destroy_process_group`` is put off until the last suite ended.

A suite that raises prints its traceback and ``SUITE <name> FAILED``; when every rank then meets
at the barrier (a failure on all ranks alike, or one the other ranks' deadlines turned into
errors), the next suite runs, and the launch exits with 1 at the end.  A rank that does not come
within ``MEET_WITHIN_S`` ends the launch at once (exit 1): the suites after it do not run.
"""
from __future__ import annotations

import json
import runpy
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from common import dist, exit_now, init

WORKERS = Path(__file__).resolve().parent
MEET_WITHIN_S = 180.0


def say(line: str) -> None:
    """One write per line: the ranks share one pipe, and a line must not be split by another's."""
    sys.stdout.write(f"[rank {dist.get_rank()}] {line}\n")
    sys.stdout.flush()


def run_suite(name: str, script: str, args: list[str]) -> bool:
    say(f"SUITE {name} START")
    sys.argv = [str(WORKERS / script), *args]
    try:
        runpy.run_path(str(WORKERS / script), run_name="__main__")
        passed = True
    except Exception:  # the suite failed here: say so, and see whether the others can go on
        traceback.print_exc()
        say(f"SUITE {name} FAILED")
        passed = False
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=MEET_WITHIN_S), wait_all_ranks=True)
    except RuntimeError as exc:
        say(f"SUITE {name}: the ranks did not meet after it, the launch stops: {exc}")
        exit_now(1)
    if passed:
        say(f"SUITE {name} END")
    return passed


def main(spec: list) -> int:
    init()
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        results = [run_suite(name, script, args) for name, script, args in spec]
    finally:
        dist.destroy_process_group = destroy
    dist.destroy_process_group()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
