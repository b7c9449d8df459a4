"""The closed-form pipeline estimate (planner/pipeline/estimate.py) against the simulator.

What it promises: (1) for equal units on stages of equal speed with no memory pressure it *is*
the 1F1B step time, (m + pp - 1) x (F + B); (2) on real cost models it ranks candidates well
enough that the planner's exact check of its best few finds the best one, and is close to the
simulated time for the candidate it prefers; (3) memory pressure only adds time, and a budget
below the model states is infinite.  Each is checked against the simulator replaying the same
units, not against a restatement of the formula.
"""
from __future__ import annotations

import math

import pytest

from infinipipe_hf.data.synthetic import prolong_like, short_only, slimpajama_like
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.batch.elastic import make_elastic_units
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.pipeline.actions import (
    backward_order,
    build_pipeline_actions,
    epp_warmup,
    one_f_one_b_warmup,
)
from infinipipe_hf.planner.pipeline.estimate import PipelineEstimator, pipeline_time_estimate
from infinipipe_hf.planner.schedules.epp_ranking import EXACT_CANDIDATES
from infinipipe_hf.planner.simulate.simulator import simulate
from tests.planner.fakes import UniformCost

SPEC = ModelSpec.from_json_file(config_path("llama2-7b"))


@pytest.mark.parametrize("p,m", [(1, 4), (2, 1), (2, 6), (4, 4), (4, 11), (8, 3)])
def test_equal_units_without_memory_pressure_equal_the_simulated_1f1b(p, m):
    units = [Unit(i, (Segment(i, 0, 8),)) for i in range(m)]
    cost = UniformCost(p, tf=1.0, tb=2.0)
    cost.memory_budget_bytes = 1e9
    plan = Plan("epp", p, 1, [8] * m, units,
                {0: build_pipeline_actions(range(m), range(m), one_f_one_b_warmup(ParallelDims(p)))}, {})
    sim = simulate(plan, cost)
    est = pipeline_time_estimate(units, cost, [8] * m)
    assert est == pytest.approx(sim.step_time_s, rel=1e-12) == (m + p - 1) * 3.0


def _candidate(lengths, k, cost):
    res = make_elastic_units(lengths, cost, k)
    units = res.units
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    acts = build_pipeline_actions([u.id for u in units], backward_order(units, lengths),
                                  epp_warmup(cost.dims, res.slice_counts[longest]))
    plan = Plan("epp", cost.dims.pp_degree, 1, list(lengths), units, {0: acts}, {}, list(cost.layers_per_stage), {})
    return pipeline_time_estimate(units, cost, lengths), simulate(plan, cost).step_time_s


BATCHES = {"slimpajama_like": slimpajama_like(64, 32768, seed=1), "prolong_like": prolong_like(32, 65536, seed=2),
           "short_only": short_only(128, 2048, seed=3)}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_ranking_finds_the_best_slice_count_within_the_exactly_checked_few(name):
    lengths = BATCHES[name]
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=4), memory_budget_bytes=1e6 * GIB)  # no memory pressure
    rows = []
    for k in (1, 2, 4, 8, 16):
        est, sim = _candidate(lengths, k, cost)
        rows.append((est, sim, k))
    by_estimate = sorted(rows)
    best_sim = min(r[1] for r in rows)
    rank_of_best = next(i for i, r in enumerate(by_estimate) if r[1] == best_sim)
    assert rank_of_best < EXACT_CANDIDATES, (name, rows)  # the planner simulates these exactly
    est, sim, _ = by_estimate[0]
    assert sim <= 1.02 * best_sim, (name, rows)  # the estimate's own pick is (nearly) the best
    assert abs(est / sim - 1) < 0.03, (name, rows)  # and its time is estimated closely


def test_memory_pressure_only_adds_time_and_too_little_memory_is_infinite():
    lengths = slimpajama_like(64, 32768, seed=4)
    roomy = CostModel(SPEC, dims=ParallelDims(pp_degree=4), memory_budget_bytes=1e6 * GIB)
    units = make_elastic_units(lengths, roomy, 4).units
    free = pipeline_time_estimate(units, roomy, lengths)
    previous = free
    for budget in (80, 60, 45, 35, 30):
        cost = CostModel(SPEC, dims=ParallelDims(pp_degree=4), memory_budget_bytes=budget * GIB)
        est = pipeline_time_estimate(units, cost, lengths)
        assert est >= previous - 1e-12 or math.isinf(est)  # less memory never makes it faster
        previous = est
    assert previous > free  # some of these budgets force recompute
    starved = CostModel(SPEC, dims=ParallelDims(pp_degree=4), memory_budget_bytes=0.5 * roomy.acts.static_bytes(0))
    assert math.isinf(pipeline_time_estimate(units, starved, lengths))
    est = PipelineEstimator(units, roomy, lengths)
    assert est.time(0, len(units)) == free and est.time(3, 3) == 0.0


@pytest.mark.parametrize("batch,budget_gib", [("slimpajama_like", 40), ("slimpajama_like", 50), ("short_only", 30)])
def test_few_windows_in_plain_floats_equal_the_numpy_windows(batch, budget_gib, monkeypatch):
    """The estimate prices a few windows in plain floats and many with numpy arrays: the same
    operations in the same order, so every (run, stage, width) gets the identical value."""
    from infinipipe_hf.planner.pipeline import estimate

    cost = CostModel(SPEC, None, ParallelDims(4), memory_budget_bytes=budget_gib * GIB)
    lengths = BATCHES[batch]
    units = make_elastic_units(lengths, cost, 4).units
    est = PipelineEstimator(units, cost, lengths)
    n = len(units)
    values = []
    for mode in (10**9, 0):  # every window in floats, then every one in numpy
        monkeypatch.setattr(estimate, "SMALL_WINDOW_COUNT", mode)
        got = [est._window_recompute(a, b, st, w) for a in range(0, n, 3) for b in range(a + 1, min(n, a + 40) + 1)
               for st in est.stages for w in {1, min(b - a, 3), b - a}]
        values.append(got)
    assert values[0] == values[1]
    # Windows that fit with recompute and windows that cannot fit both occur.
    assert any(0 < v < math.inf for v in values[0]) and any(math.isinf(v) for v in values[0])


def test_the_safety_margin_only_removes_room():
    """``safety`` is the share of the budget the estimate plans into: with the whole budget
    (``safety=1``) no run is slower, some fit that the default margin rules out, and a budget
    below the states is infinite either way."""
    lengths = BATCHES["short_only"]
    pairs = []
    for budget in range(40, 81):  # 20 to 40 GiB in halves
        cost = CostModel(SPEC, dims=ParallelDims(pp_degree=4), memory_budget_bytes=budget / 2 * GIB)
        units = make_elastic_units(lengths, cost, 1, min_token_budget=16384).units
        pairs += [(PipelineEstimator(units, cost, lengths).time(a, b),
                   PipelineEstimator(units, cost, lengths, safety=1.0).time(a, b))
                  for a in range(0, len(units), 5) for b in range(a + 1, len(units) + 1, 7)]
    assert all(whole <= margin for margin, whole in pairs)
    assert any(math.isinf(margin) and not math.isinf(whole) for margin, whole in pairs)
    assert any(math.isinf(whole) for _, whole in pairs) and any(margin == whole for margin, whole in pairs)
