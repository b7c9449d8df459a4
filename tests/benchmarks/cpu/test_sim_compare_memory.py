"""``sim_vs_real``'s per-action memory series: with SP rounds, the measured rank's own units."""
from benchmarks.cpu.sim_compare import simulated_memory_series
from infinipipe_hf.ir.rank_views import has_sub_groups
from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
from infinipipe_hf.planner.search.grad_reduce import with_reduce
from infinipipe_hf.planner.simulate.simulator import simulate
from tests.planner.search.test_plan_rounds import _plan


def test_each_ranks_series_peaks_at_most_at_the_simulated_peak_and_one_reaches_it():
    res, cost = _plan(checkpoint_levels=())
    plan = res.plan
    cost = with_reduce(cost, getattr(plan, "grad_reduce", "step") or "step")  # as the plan was priced
    assert has_sub_groups(plan)
    sim = simulate(plan, cost)
    for stage in range(plan.pp_degree):
        peaks = [max(simulated_memory_series(plan, cost, stage, r)[1]) for r in range(plan.sp_degree)]
        assert max(peaks) == sim.peak_memory_bytes[stage], (stage, peaks, sim.peak_memory_bytes[stage])
        acts, _ = simulated_memory_series(plan, cost, stage, 0)
        assert len(acts) < len(plan.stage_actions(0, stage))  # rank 0 runs only its own units
        whole = stage_timeline(plan, cost, 0, stage).point_values(
            cost, stage, plan.checkpoint_layers.get(stage, {}), plan.checkpoint_levels.get(stage, {}))
        assert whole.max() > max(peaks)  # every rank's units at once: what the series showed before
