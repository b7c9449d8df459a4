"""The checkpoint solver with a host tier: offload where the device needs it, recompute where the
host budget is too small, infeasible (with the fix) when both are, the KV store moved to host
memory when the stage does not fit otherwise."""
from __future__ import annotations

import dataclasses
from itertools import product

import numpy as np
import pytest

from infinipipe_hf.ir.levels import FINER_LEVELS, OFFLOAD
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.host_peak import host_peak_bytes_per_stage, stage_host_peak_bytes
from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
from infinipipe_hf.planner.checkpointing.points import stage_peak_bytes
from infinipipe_hf.planner.checkpointing.solver import recompute_seconds, solve_checkpointing
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.validate.validator import validate
from tests.planner.hand_plans import TINY, epp_plan

LAYERS = [3, 3]


def cost_of(budget, host):
    spec = dataclasses.replace(TINY, num_layers=sum(LAYERS))
    return CostModel(spec, dims=ParallelDims(pp_degree=2), layers_per_stage=LAYERS, memory_budget_bytes=budget,
                     host_budget_bytes=host)


def peak(plan, cost, level):
    """Device peak over stages with every layer of every unit at ``level`` (``full`` or ``offload``)."""
    out = []
    for s in range(plan.pp_degree):
        if level == OFFLOAD:
            ck, lv = {}, {u.id: {OFFLOAD: LAYERS[s]} for u in plan.units}
        else:
            ck, lv = {u.id: LAYERS[s] for u in plan.units}, {}
        out.append(stage_peak_bytes(plan, cost, 0, s, ck, checkpoint_levels=lv))
    return max(out)


@pytest.fixture(scope="module")
def setting():
    plan = epp_plan([8192, 2048, 1024, 1024], 2, 2048, 2048)
    big = cost_of(1e18, 1e18)
    full, offload = peak(plan, big, "full"), peak(plan, big, OFFLOAD)
    assert offload < full
    return plan, full, offload


def offloaded(sol):
    return sum(per.get(OFFLOAD, 0) for lv in sol.checkpoint_levels.values() for per in lv.values())


@pytest.mark.parametrize("policy,sharing", [("adaptive", "cell"), ("adaptive", "diagonal"), ("greedy", "diagonal")])
def test_device_budget_forces_offload_and_a_small_host_budget_forces_recompute(setting, policy, sharing):
    plan, full, offload = setting
    budget = full - 0.3 * (full - offload)  # below every layer recomputed: only offload fits
    roomy = cost_of(budget, 1e18)
    sol = solve_checkpointing(plan, roomy, policy=policy, sharing=sharing)
    assert sol.feasible and offloaded(sol) > 0
    plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    validate(plan, roomy)
    # A host budget holding few layer inputs: the solver demotes offload to recompute where it can.
    one_input = roomy.host.layer_offload_bytes(0, plan.units[0].segments)
    easy = full + 0.5 * (full - offload)  # whole layers fit here
    tight = cost_of(easy, 1.5 * one_input)
    sol2 = solve_checkpointing(plan, tight, policy=policy, sharing=sharing)
    assert sol2.feasible
    plan.checkpoint_layers, plan.checkpoint_levels = sol2.checkpoint_layers, sol2.checkpoint_levels
    assert max(host_peak_bytes_per_stage(plan, tight)) <= 1.5 * one_input + 1
    validate(plan, tight)
    # The same device budget with no host tier needs more recompute than with a roomy one.
    none = solve_checkpointing(plan, cost_of(easy, 0.0), policy=policy, sharing=sharing)
    more = solve_checkpointing(plan, cost_of(easy, 1e18), policy=policy, sharing=sharing)
    assert offloaded(none) == 0 and none.recompute_time_s >= more.recompute_time_s - 1e-12


def test_infeasible_when_both_budgets_are_too_small_says_which_and_how(setting):
    plan, full, offload = setting
    budget = full - 0.3 * (full - offload)
    sol = solve_checkpointing(plan, cost_of(budget, 1.0), policy="adaptive", sharing="cell")
    assert not sol.feasible
    assert "host memory" in sol.message and "--host-memory-gib" in sol.message and "stage" in sol.message
    worse = solve_checkpointing(plan, cost_of(0.9 * offload, 1e18), policy="adaptive", sharing="cell")
    assert not worse.feasible and "host memory" in worse.message and "does not fit" in worse.message


def test_finer_levels_and_offload_share_one_chain(setting):
    plan, full, offload = setting
    cost = cost_of(full - 0.3 * (full - offload), 1e18)
    sol = solve_checkpointing(plan, cost, policy="adaptive", levels=FINER_LEVELS, sharing="cell")
    assert sol.feasible and offloaded(sol) > 0
    for s, per in sol.checkpoint_layers.items():
        for u, n in per.items():
            assert n + sum(sol.checkpoint_levels.get(s, {}).get(u, {}).values()) <= LAYERS[s]
    plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    validate(plan, cost)


def test_offload_kv_bytes_and_the_solver_turning_it_on():
    plan = epp_plan([16384], 1, 1024, 1024)
    spec = dataclasses.replace(TINY, num_layers=6)
    roomy = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=1e18, host_budget_bytes=1e18)
    off = stage_timeline(plan, roomy, 0, 0)
    plan.offload_kv = [0]
    on = stage_timeline(plan, roomy, 0, 0)
    kv = off.base - on.base
    store = roomy.acts.kv_bytes(0, 16384 - 1024)  # the whole store before the last slice's backward
    assert on.host_base.max() == pytest.approx(store)
    assert kv.max() == pytest.approx(store * (1 - 1 / 6))
    np.testing.assert_allclose(on.host_base * (1 - 1 / 6), kv, rtol=1e-9)
    # A device budget only an offloaded store meets: the solver moves it to host memory.
    lv = {u.id: {OFFLOAD: 6} for u in plan.units}
    with_kv = stage_peak_bytes(plan, roomy, 0, 0, {}, checkpoint_levels=lv)
    plan.offload_kv = []
    without = stage_peak_bytes(plan, roomy, 0, 0, {}, checkpoint_levels=lv)
    assert with_kv < without
    cost = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=(with_kv + without) / 2, host_budget_bytes=1e18)
    sol = solve_checkpointing(plan, cost, policy="adaptive", sharing="cell")
    assert sol.feasible and sol.offload_kv == [0] and plan.offload_kv == [0]
    plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    validate(plan, cost)
    assert stage_host_peak_bytes(plan, cost, 0, 0) >= store
    # Without a host tier the same budget is infeasible and the plan keeps its store on the device.
    plan.offload_kv = []
    none = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=(with_kv + without) / 2)
    assert not solve_checkpointing(plan, none, policy="adaptive", sharing="cell").feasible
    assert plan.offload_kv == []


def brute_force(plan, cost, layers):
    """Least recompute over every (offload, full) pair per unit of a one-stage plan, within both budgets."""
    pairs = [(o, f) for o in range(layers + 1) for f in range(layers + 1 - o)]
    best = None
    for choice in product(pairs, repeat=len(plan.units)):
        ck = {u.id: f for u, (o, f) in zip(plan.units, choice)}
        lv = {u.id: {OFFLOAD: o} for u, (o, f) in zip(plan.units, choice) if o}
        if stage_peak_bytes(plan, cost, 0, 0, ck, checkpoint_levels=lv) > cost.memory_budget_bytes:
            continue
        if stage_host_peak_bytes(plan, cost, 0, 0, lv) > cost.host_budget_bytes:
            continue
        t = recompute_seconds(plan, cost, {0: ck}, {0: lv})
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("frac,host_inputs", [(0.3, 10.0), (0.5, 8.0), (0.6, 3.0), (0.2, 2.5)])
def test_adaptive_with_a_host_tier_matches_brute_force(frac, host_inputs):
    """The adaptive policy is optimal; the greedy (the search's) feasible exactly when brute force is."""
    plan = epp_plan([3072, 1024], 1, 1024, 1024)
    spec = dataclasses.replace(TINY, num_layers=3)
    roomy = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=1e18, host_budget_bytes=1e18)
    lo = stage_peak_bytes(plan, roomy, 0, 0, {}, checkpoint_levels={u.id: {OFFLOAD: 3} for u in plan.units})
    hi = stage_peak_bytes(plan, roomy, 0, 0, {u.id: 3 for u in plan.units}, checkpoint_levels={})
    one = roomy.host.layer_offload_bytes(0, plan.units[0].segments)
    cost = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=lo + frac * (hi - lo) * 1.5,
                     host_budget_bytes=host_inputs * one)
    best = brute_force(plan, cost, 3)
    sol = solve_checkpointing(plan, cost, policy="adaptive", sharing="cell", mip_rel_gap=0.0)
    assert sol.feasible == (best is not None) == (frac > 0.2)  # the last: the host holds too few inputs
    greedy = solve_checkpointing(plan, cost, policy="greedy", sharing="cell")
    assert greedy.feasible == sol.feasible
    if best is not None:
        assert sol.recompute_time_s == pytest.approx(best, rel=1e-6, abs=1e-12)
        assert greedy.recompute_time_s >= best * (1 - 1e-9)
