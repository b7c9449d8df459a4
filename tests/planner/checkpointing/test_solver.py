"""Adaptive checkpoint solver (planner/checkpointing/solver.py) against brute force and on big plans."""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

import numpy as np
import pytest

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing import lp
from infinipipe_hf.planner.checkpointing import solver as cs
from infinipipe_hf.planner.checkpointing.greedy import greedy_counts
from infinipipe_hf.planner.checkpointing.points import memory_points, stage_peak_bytes
from infinipipe_hf.planner.checkpointing.problem import build_problem
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from tests.planner.hand_plans import LLAMA8B, TINY, epp_plan


def peaks(plan, cost, ck_of_stage):
    return [max(stage_peak_bytes(plan, cost, r, s, ck_of_stage(s)) for r in plan.actions)
            for s in range(plan.pp_degree)]


def tiny_cost(layers, budget=1e18):
    spec = dataclasses.replace(TINY, num_layers=sum(layers))
    return CostModel(spec, dims=ParallelDims(pp_degree=len(layers)), layers_per_stage=layers, memory_budget_bytes=budget)


def budget_between(plan, spec, layers, frac):
    """A budget ``frac`` of the way from full checkpointing's peak to no checkpointing's."""
    spec = dataclasses.replace(spec, num_layers=sum(layers))
    cost = CostModel(spec, dims=ParallelDims(pp_degree=plan.pp_degree), layers_per_stage=layers, memory_budget_bytes=1e18)
    none = max(peaks(plan, cost, lambda s: {}))
    full = max(peaks(plan, cost, lambda s: {u.id: layers[s] for u in plan.units}))
    return CostModel(spec, dims=ParallelDims(pp_degree=plan.pp_degree), layers_per_stage=layers, memory_budget_bytes=full + frac * (none - full))


def brute_force(plan, cost):
    """Least recompute over diagonal-shared counts (one per diagonal and layer count), by enumeration."""
    pp = plan.pp_degree
    layers = cost.layers_per_stage
    cells, var_keys, rows = [], {}, []
    for s in range(pp):
        acts = plan.stage_actions(0, s)
        back = [a.unit for a in acts if not a.is_forward]
        for u in back:
            key = (back.index(u) + pp - 1 - s, layers[s])
            var_keys.setdefault(key, len(var_keys))
            cells.append((s, u, var_keys[key]))
        for p in memory_points(plan, cost, 0, s):
            rows.append((s, p))
    ubs = [k[1] for k in var_keys]
    shape = {u.id: UnitShape.of(u.segments) for u in plan.units}
    best = (math.inf, None)
    for x in itertools.product(*(range(ub + 1) for ub in ubs)):
        ck = {s: {} for s in range(pp)}
        t = 0.0
        for s, u, v in cells:
            ck[s][u] = x[v]
            t += cost.recompute_time(s, shape[u], x[v])
        if t >= best[0]:
            continue
        ok = all(stage_peak_bytes(plan, cost, 0, s, ck[s]) <= cost.memory_budget_bytes for s in range(pp))
        if ok:
            best = (t, ck)
    return best


SMALL_CASES = [
    # lengths, pp, layers per stage, slice tokens, unit tokens
    ([900, 300, 200, 150], 2, [2, 1], 400, 400),
    ([1200, 500, 80], 2, [1, 2], 500, 600),
    ([700, 650, 120, 100, 90], 3, [1, 1, 1], 800, 250),
    ([1000, 200, 180], 3, [2, 1, 1], 400, 400),
    ([600, 600, 300], 2, [3, 3], 350, 300),
]


@pytest.mark.parametrize("case", range(len(SMALL_CASES)))
@pytest.mark.parametrize("frac", [0.1, 0.35, 0.7])
def test_matches_brute_force(case, frac):
    lengths, pp, layers, slice_tokens, unit_tokens = SMALL_CASES[case]
    plan = epp_plan(lengths, pp, slice_tokens, unit_tokens)
    assert 3 <= len(plan.units) <= 5
    cost = budget_between(plan, TINY, layers, frac)
    want, _ = brute_force(plan, cost)
    sol = solve_checkpointing(plan, cost, mip_rel_gap=1e-6)
    assert sol.feasible and sol.method in ("milp", "greedy")
    assert want > 0, "budget must force some checkpointing for the case to test anything"
    assert sol.recompute_time_s == pytest.approx(want, rel=1e-6)
    assert max(peaks(plan, cost, lambda s: sol.checkpoint_layers[s])) <= cost.memory_budget_bytes
    for s in range(pp):
        assert set(sol.checkpoint_layers[s]) == {u.id for u in plan.units}
        assert all(0 <= c <= layers[s] for c in sol.checkpoint_layers[s].values())


def test_counts_shared_along_diagonals():
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    cost = budget_between(plan, TINY, [2, 2, 2], 0.3)
    sol = solve_checkpointing(plan, cost)
    for s in range(3):
        back = [a.unit for a in plan.stage_actions(0, s) if not a.is_forward]
        for k, u in enumerate(back):
            d = k + 2 - s
            for s2 in range(3):
                k2 = d - (2 - s2)
                back2 = [a.unit for a in plan.stage_actions(0, s2) if not a.is_forward]
                if 0 <= k2 < len(back2):
                    assert sol.checkpoint_layers[s][u] == sol.checkpoint_layers[s2][back2[k2]]


def test_greedy_feasible_whenever_full_is():
    rng = random.Random(7)
    for trial in range(25):
        n = rng.randint(3, 12)
        lengths = [rng.randint(50, 1500) for _ in range(n)]
        pp = rng.randint(2, 4)
        layers = [rng.randint(1, 3) for _ in range(pp)]
        plan = epp_plan(lengths, pp, rng.choice([300, 500, 800]), rng.choice([300, 600]))
        cost = budget_between(plan, TINY, layers, rng.uniform(0.0, 0.9))
        prob = build_problem(plan, cost, 0)
        x = greedy_counts(prob)
        assert x is not None, "full checkpointing fits by construction"
        cells = prob.columns_from_vars(x)
        ck = {s: {} for s in range(pp)}
        for s, u, c in zip(prob.cell_stage, prob.cell_unit, cells):
            ck[int(s)][int(u)] = int(c)
        assert max(peaks(plan, cost, lambda s: ck[s])) <= cost.memory_budget_bytes + 1.0
    # Below full checkpointing's peak nothing fits and greedy says so.
    tight = tiny_cost(layers, cost.memory_budget_bytes * 0.2)
    assert greedy_counts(build_problem(plan, tight, 0)) is None


def test_falls_back_to_greedy_when_solver_fails(monkeypatch):
    class Failed:
        x, status, fun, message = None, 4, None, "forced failure"

    monkeypatch.setattr(lp, "milp", lambda *a, **k: Failed())
    monkeypatch.setattr(lp, "linprog", lambda *a, **k: Failed())
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    cost = budget_between(plan, TINY, [2, 2, 2], 0.3)
    sol = solve_checkpointing(plan, cost)
    assert sol.feasible and sol.method == "greedy"
    assert "forced failure" in sol.message
    assert sol.recompute_time_s > 0
    assert max(peaks(plan, cost, lambda s: sol.checkpoint_layers[s])) <= cost.memory_budget_bytes


def test_none_needed_skips_solver(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("solver called although nothing needs checkpointing")

    monkeypatch.setattr(lp, "milp", boom)
    monkeypatch.setattr(lp, "linprog", boom)
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    cost = budget_between(plan, TINY, [2, 2, 2], 1.01)
    sol = solve_checkpointing(plan, cost)
    assert (sol.method, sol.feasible, sol.recompute_time_s) == ("none-needed", True, 0.0)
    assert all(c == 0 for per in sol.checkpoint_layers.values() for c in per.values())


def test_infeasible_names_stage_and_bytes():
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    cost = budget_between(plan, TINY, [2, 2, 2], -0.05)
    sol = solve_checkpointing(plan, cost)
    assert not sol.feasible and sol.method == "infeasible"
    assert "stage" in sol.message and "budget" in sol.message and "GiB" in sol.message
    assert f"{cost.memory_budget_bytes:.0f} bytes" in sol.message
    for policy in ("none", "full", "uniform"):
        got = solve_checkpointing(plan, cost, policy=policy)
        assert not got.feasible and got.method == "infeasible" and "stage" in got.message


def test_static_policies():
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    layers = [2, 3, 1]
    cost = budget_between(plan, TINY, layers, 0.5)
    full = solve_checkpointing(plan, cost, policy="full")
    assert full.feasible and full.method == "full"
    assert all(c == layers[s] for s, per in full.checkpoint_layers.items() for c in per.values())
    none = solve_checkpointing(plan, cost, policy="none")
    assert not none.feasible and none.recompute_time_s == 0.0
    uni = solve_checkpointing(plan, cost, policy="uniform")
    assert uni.feasible and uni.method == "uniform"
    c = max(max(per.values()) for per in uni.checkpoint_layers.values())
    assert c >= 1
    assert all(n == min(c, layers[s]) for s, per in uni.checkpoint_layers.items() for n in per.values())
    less = {s: min(c - 1, layers[s]) for s in range(3)}
    assert max(peaks(plan, cost, lambda s: {u.id: less[s] for u in plan.units})) > cost.memory_budget_bytes
    adaptive = solve_checkpointing(plan, cost)
    assert adaptive.recompute_time_s <= uni.recompute_time_s <= full.recompute_time_s


def test_user_errors():
    plan = epp_plan([900, 300, 200], 2, 400, 400)
    cost = tiny_cost([3, 3])
    with pytest.raises(ValueError, match="policy"):
        solve_checkpointing(plan, cost, policy="sometimes")
    with pytest.raises(ValueError, match="pp_degree"):
        solve_checkpointing(plan, tiny_cost([2, 2, 2]))
    plan.layers_per_stage = [2, 4]
    with pytest.raises(ValueError, match="layers_per_stage"):
        solve_checkpointing(plan, cost)
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_checkpointing(plan, tiny_cost([2, 4]), time_limit_s=-1.0)


def test_dp_replicas_solved_separately():
    plan = epp_plan([1500, 1400, 700, 600, 500, 300, 200, 150], 2, 500, 700, dp=2)
    cost = budget_between(plan, TINY, [3, 3], 0.3)
    sol = solve_checkpointing(plan, cost)
    assert sol.feasible
    for r in (0, 1):
        for s in (0, 1):
            assert stage_peak_bytes(plan, cost, r, s, sol.checkpoint_layers[s]) <= cost.memory_budget_bytes


def big_plan(pp, seed=0):
    rng = random.Random(seed)
    lengths = [min(131072, max(64, int(rng.lognormvariate(math.log(2000), 1.3)))) for _ in range(512)]
    return epp_plan(lengths, pp, 16384, 8192)


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("frac", [0.2, 0.8])
def test_large_plan_is_fast(pp, frac):
    plan = big_plan(pp)
    layers = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=pp)).layers_per_stage
    cost = budget_between(plan, LLAMA8B, layers, frac)
    t0 = time.perf_counter()
    sol = solve_checkpointing(plan, cost, time_limit_s=1.0)  # what plan_step passes
    dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    uni = solve_checkpointing(plan, cost, policy="uniform")
    dt_uni = time.perf_counter() - t0
    print(f"\n512 sequences, {len(plan.units)} units, pp={pp}, budget frac {frac}: adaptive {dt:.3f} s "
          f"({sol.method}, recompute {sol.recompute_time_s:.2f} s; {sol.message or 'ok'}), "
          f"uniform {dt_uni:.3f} s (recompute {uni.recompute_time_s:.2f} s)")
    assert sol.feasible and dt < 5.0
    assert sol.recompute_time_s < uni.recompute_time_s
    assert max(peaks(plan, cost, lambda s: sol.checkpoint_layers[s])) <= cost.memory_budget_bytes


def test_time_limit_is_respected():
    plan = big_plan(8)
    cost = budget_between(plan, LLAMA8B, CostModel(LLAMA8B, dims=ParallelDims(pp_degree=8)).layers_per_stage, 0.3)
    t0 = time.perf_counter()
    sol = solve_checkpointing(plan, cost, time_limit_s=0.3)
    assert sol.feasible and time.perf_counter() - t0 < 1.5


def test_deterministic():
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    cost = budget_between(plan, TINY, [2, 2, 2], 0.3)
    a, b = solve_checkpointing(plan, cost), solve_checkpointing(plan, cost)
    assert a.checkpoint_layers == b.checkpoint_layers and a.recompute_time_s == b.recompute_time_s


def test_zero_time_limit_never_branches(monkeypatch):
    """``time_limit_s=0`` (the planner's default) stops at the rounded LP and the greedy: no MILP,
    so no wall-clock limit can change the answer; with a limit the MILP runs on the same problem."""
    plan = big_plan(8)
    cost = budget_between(plan, LLAMA8B, CostModel(LLAMA8B, dims=ParallelDims(pp_degree=8)).layers_per_stage, 0.3)
    calls = []
    real = lp.milp
    monkeypatch.setattr(lp, "milp", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b = solve_checkpointing(plan, cost, time_limit_s=0), solve_checkpointing(plan, cost, time_limit_s=0)
    assert not calls and a.feasible and a.method in ("lp-rounding", "greedy", "milp")
    assert a.checkpoint_layers == b.checkpoint_layers and a.checkpoint_levels == b.checkpoint_levels
    assert max(peaks(plan, cost, lambda s: a.checkpoint_layers[s])) <= cost.memory_budget_bytes
    timed = solve_checkpointing(plan, cost, time_limit_s=1.0)
    assert calls and timed.recompute_time_s <= a.recompute_time_s + 1e-12


def test_greedy_policy_never_calls_solver(monkeypatch):
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    cost = budget_between(plan, TINY, [2, 2, 2], 0.3)
    adaptive = solve_checkpointing(plan, cost)

    def boom(*a, **k):
        raise AssertionError("greedy policy must not call HiGHS")

    monkeypatch.setattr(lp, "milp", boom)
    monkeypatch.setattr(lp, "linprog", boom)
    sol = solve_checkpointing(plan, cost, policy="greedy")
    assert sol.feasible and sol.method == "greedy"
    assert adaptive.recompute_time_s <= sol.recompute_time_s + 1e-12
    assert max(peaks(plan, cost, lambda s: sol.checkpoint_layers[s])) <= cost.memory_budget_bytes


def test_replica_without_units():
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 2, 500, 700)
    plan = Plan(plan.schedule, 2, 2, plan.sequences, plan.units, {0: plan.actions[0], 1: [[], []]}, {})
    cost = budget_between(plan, TINY, [2, 2], 0.3)
    for policy in cs.POLICIES:
        sol = solve_checkpointing(plan, cost, policy=policy)
        assert set(sol.checkpoint_layers) == {0, 1}
        assert set(sol.checkpoint_layers[0]) == {u.id for u in plan.units}
    assert solve_checkpointing(plan, cost).feasible


def test_dropped_points_are_dominated_by_kept_ones():
    from infinipipe_hf.planner.checkpointing.dominance import undominated
    from infinipipe_hf.planner.checkpointing.live_windows import live_windows

    rng = random.Random(3)
    for trial in range(20):
        lengths = [rng.randint(50, 1500) for _ in range(rng.randint(3, 12))]
        pp = rng.randint(2, 4)
        plan = epp_plan(lengths, pp, rng.choice([300, 500]), rng.choice([300, 600]))
        cost = tiny_cost([1] * pp)
        for s in range(pp):
            pts = memory_points(plan, cost, 0, s)
            firsts, lasts = live_windows(pts, plan.stage_actions(0, s))
            base = np.array([p.base_bytes for p in pts])
            keep = undominated(base, np.array(firsts), np.array(lasts))
            assert keep.any()
            kept = [p for p, k in zip(pts, keep) if k]
            for p, k in zip(pts, keep):
                dominators = [q for q in kept if q is not p and set(p.live_units) <= set(q.live_units)
                              and q.base_bytes >= p.base_bytes]
                assert bool(dominators) == (not k)


def test_a_stage_that_fits_only_without_the_rebuilt_layer_checkpoints_nothing():
    """The solver's rows count, at every backward, a layer the running unit rebuilds; a stage that
    checkpoints nothing rebuilds none.  Between the two peaks the answer is ``none-needed`` (no
    recompute), and the simulator and validator judge that plan by its exact points: it fits."""
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.models.model_configs import config_path
    from infinipipe_hf.planner.search.api import PlanOptions, plan_step
    from infinipipe_hf.planner.simulate.simulator import simulate
    from infinipipe_hf.planner.validate.validator import validate

    spec = ModelSpec.from_json_file(config_path("llama2-7b"))
    lengths = [4096, 3000, 2500, 1200]
    roomy = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=1e15)
    plan = plan_step(lengths, spec, options=PlanOptions(checkpointing="none"), cost=roomy).plan
    exact = stage_peak_bytes(plan, roomy, 0, 0, {})
    biggest = max(plan.units, key=lambda u: u.num_tokens)
    rebuilt = roomy.acts.rebuilt_bound_bytes(0, biggest.num_tokens)
    assert rebuilt > 0
    cost = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=exact + rebuilt / 2)
    sol = solve_checkpointing(plan, cost)
    assert sol.feasible and sol.method == "none-needed" and sol.recompute_time_s == 0.0
    plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    assert simulate(plan, cost).feasible
    validate(plan, cost)  # raises when a stage is over budget
