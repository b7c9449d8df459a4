"""EPP's candidate order when the device alone holds none of them: more slices first without a
host tier; with one, the fastest with memory ignored first (the host takes what the device
cannot hold, and fewer, larger units pay fewer per-unit terms), planned past those that do not fit."""
import math

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.batch.dp_assign import assign_sequences
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.registry import SCHEDULES
from infinipipe_hf.planner.schedules.epp_ranking import EXACT_CANDIDATES, ranked_settings
from infinipipe_hf.planner.schedules.epp_units import margin_estimate
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.search.loop import run_search
from infinipipe_hf.planner.simulate.simulator import simulate

SPEC = ModelSpec.from_json_file(config_path("llama2-13b"))
LENGTHS = [16384] * 16
"""16 documents of 16K tokens on 13B at pp 4, 28 GiB per GPU: no candidate fits the device alone."""


def _context(host_gib: float) -> PipelineContext:
    dims = ParallelDims(4, 1, 1, "none", 8, state_offload="optimizer")
    cost = CostModel(SPEC, default_profile(), dims, memory_budget_bytes=28 * GIB, host_budget_bytes=host_gib * GIB)
    return PipelineContext(LENGTHS, assign_sequences(LENGTHS, 1, cost), cost, "adaptive", None, None, 0.0, False)


@pytest.mark.parametrize("host_gib", [0.0, 256.0])
def test_candidates_the_device_cannot_hold_are_ordered_by_what_may_hold_them(host_gib):
    ctx = _context(host_gib)
    ranked, _ = ranked_settings(ctx)
    assert ranked and all(math.isinf(r[0]) for r in ranked)
    slices = [r[1] for r in ranked]
    if not host_gib:
        assert slices == sorted(slices, reverse=True)
        return
    free = [margin_estimate(r[3], ctx.cost, LENGTHS, safety=math.inf) for r in ranked]
    assert free == sorted(free)
    # Here fewer slices are faster with memory ignored, so the order differs from the device's.
    assert slices[:EXACT_CANDIDATES] != sorted(slices, reverse=True)[:EXACT_CANDIDATES]


def test_with_a_host_tier_the_plan_is_as_fast_as_the_best_of_the_more_slices_first_candidates():
    """The order the device alone uses (more slices first) planned its first few many-unit
    candidates; with a host tier the search returns a plan at least as fast as any of them."""
    ctx = _context(256.0)
    sched = SCHEDULES["epp"]
    by_slices = sorted(ranked_settings(ctx)[0], key=lambda r: -r[1])[:EXACT_CANDIDATES]
    steps = []
    for _, k, floor, staged in by_slices:
        plan = sched.plan(LENGTHS, ctx.replicas, ctx.cost, k, floor, staged, "adaptive", 0.0)
        sim = simulate(plan, ctx.cost)
        assert sim.feasible
        steps.append(sim.step_time_s)
    got = plan_step(LENGTHS, SPEC, options=PlanOptions(), cost=ctx.cost)
    assert got.feasible
    assert got.simulation.step_time_s <= min(steps)


def test_the_candidates_bound_leaves_out_only_candidates_that_do_not_fit():
    """The bound under a step every replay beats is the replay of the first candidate whose own plan
    fits (those before it do not); the plans it built go to the search, which then plans the same."""
    ctx = _context(256.0)
    sched = SCHEDULES["epp"]
    ranked = ranked_settings(ctx)[0]
    fits = []
    for _, k, floor, staged in ranked:
        try:
            fits.append(simulate(sched.plan(LENGTHS, ctx.replicas, ctx.cost, k, floor, staged, "adaptive", 0.0),
                                 ctx.cost).feasible)
        except ValueError:
            fits.append(False)
    first = fits.index(True)
    assert first > 0  # the fastest with memory ignored do not fit here
    _, k, floor, staged = ranked[first]
    replay = simulate(sched.units_plan(LENGTHS, ctx.replicas, ctx.cost, k, floor, staged), ctx.cost,
                      memory=False).step_time_s
    fresh = _context(256.0)
    assert sched.candidates_bound(fresh, math.inf) == replay
    full = plan_step(LENGTHS, SPEC, options=PlanOptions(), cost=ctx.cost)
    assert replay <= full.simulation.step_time_s
    state = run_search(sched, fresh)  # reuses what the bound built
    again = run_search(sched, _context(256.0))
    assert [t.get("feasible") for t in state.tried] == [t.get("feasible") for t in again.tried]
    assert state.best[1].step_time_s == again.best[1].step_time_s
