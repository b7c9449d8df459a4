"""The validator's host-tier checks: a hand-made plan over the host budget is refused naming the
stage, the unit, the bytes and the fix; offload counts against no device bytes; bad offload_kv."""
from __future__ import annotations

import dataclasses

import pytest

from infinipipe_hf.ir.levels import OFFLOAD
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.host_peak import stage_host_peak_bytes
from infinipipe_hf.planner.checkpointing.points import stage_peak_bytes
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.validate.validator import PlanValidationError, validate
from tests.planner.hand_plans import TINY, epp_plan


def offloaded_plan():
    plan = epp_plan([4096, 2048], 2, 2048, 2048)
    plan.checkpoint_layers = {s: {u.id: 0 for u in plan.units} for s in range(2)}
    plan.checkpoint_levels = {s: {u.id: {OFFLOAD: 3} for u in plan.units} for s in range(2)}
    return plan


def cost_of(host, budget=1e18):
    spec = dataclasses.replace(TINY, num_layers=6)
    return CostModel(spec, dims=ParallelDims(pp_degree=2), layers_per_stage=[3, 3], memory_budget_bytes=budget,
                     host_budget_bytes=host)


def test_plan_over_the_host_budget_is_refused_with_stage_unit_bytes_and_fix():
    plan = offloaded_plan()
    roomy = cost_of(1e18)
    validate(plan, roomy)
    need = stage_host_peak_bytes(plan, roomy, 0, 0)
    # By hand: stage 0 holds every live unit's 3 offloaded inputs; all three units are live at once.
    by_hand = sum(3 * u.num_tokens * TINY.hidden_size * roomy.profile.bytes_per_element for u in plan.units)
    assert need == pytest.approx(by_hand)
    with pytest.raises(PlanValidationError) as err:
        validate(plan, cost_of(need / 2))
    msg = str(err.value)
    for words in ("stage 0", "host memory", "unit ", "offloads 3 layer inputs", f"{need:.0f} bytes",
                  "--host-memory-gib", "host_memory_gib"):
        assert words in msg, words
    with pytest.raises(PlanValidationError, match="give the plan a host budget"):
        validate(plan, cost_of(0.0))


def test_offloaded_layers_keep_no_device_bytes():
    plan = offloaded_plan()
    cost = cost_of(1e18)
    offloaded = stage_peak_bytes(plan, cost, 0, 0)
    whole = stage_peak_bytes(plan, cost, 0, 0, {u.id: 3 for u in plan.units}, checkpoint_levels={})
    inputs = sum(3 * u.num_tokens * TINY.hidden_size * cost.profile.bytes_per_element for u in plan.units)
    assert whole - offloaded == pytest.approx(inputs, rel=0.25)  # the held inputs, less phase shifts
    assert offloaded < whole
    with pytest.raises(PlanValidationError, match="over the budget"):
        validate(plan, cost_of(1e18, budget=offloaded * 0.99))


def test_offload_kv_must_name_distinct_stages():
    plan = offloaded_plan()
    plan.offload_kv = [2]
    with pytest.raises(PlanValidationError, match=r"offload_kv=\[2\] must name distinct stages in 0..1"):
        validate(plan, cost_of(1e18))
