"""Per-unit gradient reduction of sharded stages (``grad_reduce="unit"``) against the unsplit model.

``workers/grad_reduce_unit.py``: at sp 2 (2 ranks) hand-made plans with elastic SP rounds and on
the whole SP group, the engine's planner (``unit`` over two accumulated steps, ``auto``), exact in
float64; after every unit's backward no layer holds an unsharded gradient under ``unit`` while the
``step`` control does; refusals.  At 4 ranks pp 2 x sp 2 and dp 2 x sp 2 (shard "sp"), exact, and
"hybrid" over 2 replicas refused.  Expected case names are listed so a case that silently stops
running fails.
"""
from __future__ import annotations

import re

import pytest

from tests.distributed.launch import LaunchResult, check_cases, run_ranks

pytestmark = pytest.mark.distributed

SP2_CASES = ["sp2_unit_rounds_tied", "sp2_step_rounds_tied_control", "sp2_unit_whole_group_mistral",
             "sp2_planner_unit_two_steps", "sp2_planner_auto", "bad_unit_plan_on_unsharded",
             "good_step_after_refusal", "bad_config_unit_dp_replicas", "bad_config_unit_unsharded",
             "bad_grad_reduce_value"]
WORLD4_CASES = ["pp2sp2_unit_rounds_tied", "dp2sp2_shard_sp_unit_rounds", "dp2sp2_hybrid_unit_refused"]


def _launch(mode: str, nproc: int, timeout_s: float) -> LaunchResult:
    results = run_ranks("grad_reduce_unit.py", nproc, [mode], timeout_s=timeout_s)
    return LaunchResult(returncode=max(abs(r.returncode) for r in results),
                        output="\n".join(r.output for r in results),
                        elapsed_s=max(r.elapsed_s for r in results), timed_out=any(r.timed_out for r in results))


@pytest.mark.timeout(600)
def test_unit_reduce_sp2_exact_memory_and_refusals():
    result = _launch("sp2", 2, 500)
    check_cases(result, 2, SP2_CASES)
    # Under "unit" nothing unsharded outlives a backward; the "step" control keeps it (> 0).
    for seen in re.findall(r"CASE sp2_unit_\S+ OK .*unsharded_after_backward=\[([\d, ]+)\]", result.output):
        assert set(seen.replace(" ", "").split(",")) == {"0"}, seen
    controls = re.findall(r"CASE sp2_step_rounds_tied_control OK .*unsharded_after_backward=\[([\d, ]+)\]",
                          result.output)
    assert len(controls) == 2 and all(min(map(int, c.split(","))) > 0 for c in controls), controls


@pytest.mark.timeout(900)
def test_unit_reduce_pp2_and_dp2_with_sp2_exact():
    check_cases(_launch("world4", 4, 800), 4, WORLD4_CASES)
