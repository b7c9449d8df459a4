"""The ``offload_attn`` level in the checkpoint solver: with room on the host it replaces
``offload`` (no device bytes either, no attention core rerun), the host budget decides between the
two, and every answer keeps its chains and both budgets."""
from __future__ import annotations

import dataclasses

import pytest

from infinipipe_hf.ir.levels import FINER_LEVELS, FULL, KEEP_ATTN, OFFLOAD, OFFLOAD_ATTN, OFFLOAD_PAIR
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.host_peak import host_peak_bytes_per_stage
from infinipipe_hf.planner.checkpointing.points import stage_peak_bytes
from infinipipe_hf.planner.checkpointing.problem import build_problem
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.validate.validator import validate
from tests.planner.hand_plans import TINY, epp_plan

LAYERS = [3, 3]


def cost_of(budget, host):
    spec = dataclasses.replace(TINY, num_layers=sum(LAYERS))
    return CostModel(spec, dims=ParallelDims(pp_degree=2), layers_per_stage=LAYERS, memory_budget_bytes=budget,
                     host_budget_bytes=host)


def count(sol, level):
    return sum(per.get(level, 0) for lv in sol.checkpoint_levels.values() for per in lv.values())


@pytest.fixture(scope="module")
def setting():
    plan = epp_plan([8192, 2048, 1024, 1024], 2, 2048, 2048)
    big = cost_of(1e18, 1e18)
    seg = plan.units[0].segments
    return plan, big, seg


def test_host_bytes_and_recompute_of_the_level(setting):
    plan, cost, seg = setting
    h = cost.acts.hidden_bytes_per_token
    kept = h + TINY.num_attention_heads * max(4.0, cost.profile.bytes_per_element)
    tokens = sum(s.end - s.start for s in seg)
    assert cost.host.layer_offload_bytes(0, seg, OFFLOAD) == tokens * h
    assert cost.host.layer_offload_bytes(0, seg, OFFLOAD_ATTN) == pytest.approx(tokens * (h + kept))
    # Everything on the device is saved either way; the attention core is not rerun.
    lc = cost.levels
    assert lc.layer_saved_bytes(OFFLOAD_ATTN, 0, seg) == lc.layer_saved_bytes(OFFLOAD, 0, seg)
    shape = UnitShape.of(seg)
    exposed = cost.host.layer_exposed_s(shape, OFFLOAD_ATTN)
    assert lc.layer_recompute_s(OFFLOAD_ATTN, shape) == pytest.approx(lc.layer_recompute_s(KEEP_ATTN, shape) + exposed)
    # On a long slice the copies hide behind the compute and the core dominates the replay.
    long = UnitShape.of([Segment(0, 0, 1 << 16)])
    assert cost.host.layer_exposed_s(long, OFFLOAD_ATTN) == 0.0
    assert lc.layer_recompute_s(OFFLOAD_ATTN, long) < 0.5 * lc.layer_recompute_s(FULL, long)
    with pytest.raises(ValueError, match="keeps nothing in host memory"):
        cost.host.layer_host_bytes_per_token(FULL)


def test_the_level_heads_the_chain_only_where_keep_attn_may_run(setting):
    plan, cost, _ = setting
    assert build_problem(plan, cost, 0, levels=FINER_LEVELS).levels[:4] == (OFFLOAD_ATTN, OFFLOAD_PAIR, OFFLOAD, FULL)
    assert build_problem(plan, cost, 0, levels=("mlp", "mlp_act")).levels[:2] == (OFFLOAD, FULL)
    no_host = build_problem(plan, cost_of(1e18, 0.0), 0, levels=FINER_LEVELS).levels
    assert OFFLOAD_ATTN not in no_host and OFFLOAD_PAIR not in no_host


def host_levels_needed_budget(plan, big) -> float:
    """A device budget between every layer whole and every layer at ``offload``: only host levels
    fit it for some layers."""
    full = offload = 0.0
    for s in range(plan.pp_degree):
        full = max(full, stage_peak_bytes(plan, big, 0, s, {u.id: LAYERS[s] for u in plan.units}))
        offload = max(offload, stage_peak_bytes(plan, big, 0, s, {}, checkpoint_levels={
            u.id: {OFFLOAD: LAYERS[s]} for u in plan.units}))
    return full - 0.3 * (full - offload)


@pytest.mark.parametrize("policy,sharing", [("adaptive", "cell"), ("adaptive", "diagonal"), ("greedy", "diagonal")])
def test_roomy_host_takes_offload_attn_a_tight_one_offload(setting, policy, sharing):
    plan, big, _ = setting
    budget = host_levels_needed_budget(plan, big)
    roomy = cost_of(budget, 1e18)
    sol = solve_checkpointing(plan, roomy, policy=policy, sharing=sharing, levels=FINER_LEVELS)
    assert sol.feasible and count(sol, OFFLOAD_ATTN) > 0
    lc, shapes = roomy.levels, {u.id: UnitShape.of(u.segments) for u in plan.units}
    for per in sol.checkpoint_levels.values() if sharing == "cell" else ():  # each unit's cheaper host level
        for uid, counts in per.items():
            if counts.get(OFFLOAD):  # short units, whose larger copies do not hide
                assert lc.layer_recompute_s(OFFLOAD, shapes[uid]) <= lc.layer_recompute_s(OFFLOAD_ATTN, shapes[uid])
    plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    validate(plan, roomy)
    roomy_peak = max(host_peak_bytes_per_stage(plan, roomy))
    # A host budget short of that: offload_attn gives way to offload, within the budget, slower.
    tight = cost_of(budget, 0.6 * roomy_peak)
    sol2 = solve_checkpointing(plan, tight, policy=policy, sharing=sharing, levels=FINER_LEVELS)
    assert sol2.feasible
    plan.checkpoint_layers, plan.checkpoint_levels = sol2.checkpoint_layers, sol2.checkpoint_levels
    assert max(host_peak_bytes_per_stage(plan, tight)) <= 0.6 * roomy_peak + 1
    validate(plan, tight)  # counts stay non-negative: the chains held through the host repair
    assert count(sol2, OFFLOAD_ATTN) < count(sol, OFFLOAD_ATTN)
    assert sol2.recompute_time_s > sol.recompute_time_s
