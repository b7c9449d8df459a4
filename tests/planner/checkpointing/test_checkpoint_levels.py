"""Checkpoint levels in the planner: the solver against brute force, the greedy's guarantees, plan
JSON and validation, the simulator's recompute and plan_step's info, all with levels."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import numpy as np
import pytest

from infinipipe_hf.ir.levels import FINER_LEVELS, CheckpointMix, check_levels
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.greedy import greedy_counts
from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
from infinipipe_hf.planner.checkpointing.points import stage_peak_bytes
from infinipipe_hf.planner.checkpointing.problem import build_problem
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.activations import act_elements
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.levels import LevelCosts
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.simulate.simulator import simulate
from infinipipe_hf.planner.validate.validator import PlanValidationError, validate
from tests.planner.hand_plans import TINY, epp_plan

LEVELS = FINER_LEVELS  # keep_attn, mlp, mlp_act


def mixes(layers):
    """Every (full, keep_attn, mlp, mlp_act) with at most ``layers`` layers in all."""
    return [CheckpointMix(f, m, a, k) for f in range(layers + 1) for k in range(layers + 1 - f)
            for m in range(layers + 1 - f - k) for a in range(layers + 1 - f - k - m)]


def level_peaks(plan, cost, ck, lv):
    return [stage_peak_bytes(plan, cost, 0, s, ck.get(s, {}), checkpoint_levels=lv.get(s, {}))
            for s in range(plan.pp_degree)]


def cost_between(plan, layers, frac):
    spec = dataclasses.replace(TINY, num_layers=sum(layers))
    cost = CostModel(spec, dims=ParallelDims(pp_degree=plan.pp_degree), layers_per_stage=layers, memory_budget_bytes=1e18)
    none = max(level_peaks(plan, cost, {}, {}))
    full = max(level_peaks(plan, cost, {s: {u.id: layers[s] for u in plan.units} for s in range(plan.pp_degree)}, {}))
    return CostModel(spec, dims=ParallelDims(pp_degree=plan.pp_degree), layers_per_stage=layers, memory_budget_bytes=full + frac * (none - full))


def brute_force_cells(plan, cost):
    """Least recompute with a mix of its own per (stage, unit), by enumeration stage by stage (the
    memory of a stage depends only on its own cells)."""
    total, best_mix = 0.0, {}
    shape = {u.id: UnitShape.of(u.segments) for u in plan.units}
    for s in range(plan.pp_degree):
        units = [a.unit for a in plan.stage_actions(0, s) if a.is_forward]
        tl = stage_timeline(plan, cost, 0, s)
        best = (math.inf, None)
        options = mixes(cost.layers_per_stage[s])
        secs = {(u, m): cost.levels.recompute_time(s, shape[u], m) for u in units for m in options}
        for combo in itertools.product(options, repeat=len(units)):
            t = sum(secs[(u, m)] for u, m in zip(units, combo))
            if t >= best[0]:
                continue
            ck = {u: m.full for u, m in zip(units, combo)}
            lv = {u: m.finer for u, m in zip(units, combo)}
            if tl.peak(cost, s, ck, lv) <= cost.memory_budget_bytes:
                best = (t, combo)
        assert best[1] is not None, "full checkpointing fits by construction"
        total += best[0]
        best_mix[s] = dict(zip(units, best[1]))
    return total, best_mix


CASES = [
    # lengths, pp, layers per stage, slice tokens, unit tokens (3-4 units: enumeration stays small)
    ([900, 300, 200, 150], 2, [2, 1], 500, 400),
    ([1200, 500, 80], 2, [1, 2], 500, 600),
    ([1000, 200, 180], 2, [2, 2], 400, 400),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("frac", [0.15, 0.5, 0.85])
def test_levels_match_brute_force(case, frac):
    lengths, pp, layers, slice_tokens, unit_tokens = CASES[case]
    plan = epp_plan(lengths, pp, slice_tokens, unit_tokens)
    assert 3 <= len(plan.units) <= 4
    cost = cost_between(plan, layers, frac)
    want, _ = brute_force_cells(plan, cost)
    assert want > 0
    sol = solve_checkpointing(plan, cost, levels=LEVELS, sharing="cell", mip_rel_gap=1e-9)
    assert sol.feasible and sol.method in ("milp", "lp-rounding", "greedy")
    assert sol.recompute_time_s == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert max(level_peaks(plan, cost, sol.checkpoint_layers, sol.checkpoint_levels)) <= cost.memory_budget_bytes
    for s in range(pp):
        for u in plan.units:
            m = CheckpointMix.of(sol.checkpoint_layers[s][u.id], sol.checkpoint_levels.get(s, {}).get(u.id))
            assert m.total <= layers[s]
    # Whole layers only is one of the choices, so levels never cost more recompute.
    whole = solve_checkpointing(plan, cost, sharing="cell", mip_rel_gap=1e-9)
    assert sol.recompute_time_s <= whole.recompute_time_s * (1 + 1e-9)


def test_levels_used_and_cheaper_on_some_case():
    lengths, pp, layers, slice_tokens, unit_tokens = CASES[0]
    plan = epp_plan(lengths, pp, slice_tokens, unit_tokens)
    cost = cost_between(plan, layers, 0.85)
    sol = solve_checkpointing(plan, cost, levels=LEVELS, sharing="cell")
    whole = solve_checkpointing(plan, cost, sharing="cell")
    assert sol.checkpoint_levels, "a budget just under no checkpointing wants the cheap levels"
    assert sol.recompute_time_s < 0.9 * whole.recompute_time_s


def test_keep_attn_chosen_where_memory_is_tight():
    """The brute-force cases do exercise keep_attn: at a tight budget its optimum uses it."""
    lengths, pp, layers, slice_tokens, unit_tokens = CASES[1]
    plan = epp_plan(lengths, pp, slice_tokens, unit_tokens)
    cost = cost_between(plan, layers, 0.5)
    _, best = brute_force_cells(plan, cost)
    assert any(m.keep_attn for per in best.values() for m in per.values())
    sol = solve_checkpointing(plan, cost, levels=LEVELS, sharing="cell", mip_rel_gap=1e-9)
    assert any("keep_attn" in per for st in sol.checkpoint_levels.values() for per in st.values())
    without = solve_checkpointing(plan, cost, levels=("mlp", "mlp_act"), sharing="cell", mip_rel_gap=1e-9)
    assert sol.recompute_time_s < without.recompute_time_s


@pytest.mark.parametrize("sharing", ["cell", "diagonal"])
def test_greedy_with_levels_feasible_whenever_full_is(sharing):
    rng = random.Random(11)
    for _ in range(8):
        lengths = [rng.randint(50, 1500) for _ in range(rng.randint(3, 10))]
        pp = rng.randint(2, 4)
        layers = [rng.randint(1, 3) for _ in range(pp)]
        plan = epp_plan(lengths, pp, rng.choice([300, 500, 800]), rng.choice([300, 600]))
        cost = cost_between(plan, layers, rng.uniform(0.0, 0.95))
        prob = build_problem(plan, cost, 0, levels=LEVELS, sharing=sharing)
        x = greedy_counts(prob)
        assert x is not None
        # The chain holds: y_full <= y_mlp <= y_mlp_act <= layers.
        has = prob.var_parent >= 0
        assert (x[has] <= x[prob.var_parent[has]]).all() and (x <= prob.var_ub).all() and (x >= 0).all()
        sol = solve_checkpointing(plan, cost, levels=LEVELS, sharing=sharing, policy="greedy")
        assert sol.feasible
        assert max(level_peaks(plan, cost, sol.checkpoint_layers, sol.checkpoint_levels)) <= cost.memory_budget_bytes + 1
        adaptive = solve_checkpointing(plan, cost, levels=LEVELS, sharing=sharing)
        assert adaptive.recompute_time_s <= sol.recompute_time_s * (1 + 1e-9) + 1e-12


def test_cell_sharing_never_worse_than_diagonal():
    """Diagonal sharing is cell sharing with equality constraints added: it can only cost more."""
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    for frac in (0.2, 0.5, 0.8):
        cost = cost_between(plan, [2, 2, 2], frac)
        for levels in ((), LEVELS):
            cell = solve_checkpointing(plan, cost, levels=levels, sharing="cell", mip_rel_gap=1e-9)
            diag = solve_checkpointing(plan, cost, levels=levels, sharing="diagonal", mip_rel_gap=1e-9)
            assert cell.recompute_time_s <= diag.recompute_time_s * (1 + 1e-9)


def test_stage_blocks_solve_like_the_whole():
    plan = epp_plan([1500, 700, 600, 500, 300, 200], 3, 500, 700)
    cost = cost_between(plan, [2, 2, 2], 0.4)
    prob = build_problem(plan, cost, 0, levels=LEVELS, sharing="cell")
    blocks = prob.stage_blocks()
    assert len(blocks) == 3 and sorted(np.concatenate([i for _, i in blocks]).tolist()) == list(range(prob.num_vars))
    assert sum(len(b.need) for b, _ in blocks) == len(prob.need)
    x = np.zeros(prob.num_vars, dtype=np.int64)
    for b, idx in blocks:
        xb = greedy_counts(b)
        x[idx] = xb
        assert (b.overshoot(b.columns_from_vars(xb)) <= 1).all()
    assert (prob.overshoot(prob.columns_from_vars(x)) <= 1).all()
    assert len(build_problem(plan, cost, 0, levels=LEVELS, sharing="diagonal").stage_blocks()) == 1


def test_level_costs_are_ordered_and_shares_exact():
    spec = ModelSpec("llama", 32, 4096, 11008, 32, 32, 128, 32000, False)
    cost = CostModel(spec, dims=ParallelDims(pp_degree=4))
    lc = cost.levels
    assert isinstance(lc, LevelCosts)
    # Shares of the bf16 element count: 4 x and 2 x intermediate of 10 h + 4 i + 2 kv.
    total = 10 * 4096 + 4 * 11008 + 2 * 4096
    assert act_elements(4096, 11008, 4096) == total
    assert lc.saved_share == {"mlp": 4 * 11008 / total, "mlp_act": 2 * 11008 / total}
    for tokens, context in ((512, 0), (8192, 0), (4096, 60000)):
        shape = UnitShape(float(tokens * tokens + 2 * context * tokens), tokens)
        full, keep, mlp, act = (lc.layer_recompute_s(lv, shape) for lv in ("full", "keep_attn", "mlp", "mlp_act"))
        assert 0 < act < mlp < keep < full < cost.coefficients.layer_fwd(shape.pairs, shape.tokens)
        # keep_attn skips exactly the attention core: the fit's pair term.
        core = cost.coefficients.layer_fwd(shape.pairs, shape.tokens) - cost.coefficients.layer_fwd(0, shape.tokens)
        assert full - keep == pytest.approx(core, rel=1e-12)
        if context:  # a slice far into its sequence: the core is most of the replay
            assert keep < 0.5 * full
    segments = [Segment(0, 60000, 64096)]
    saved = {lv: lc.layer_saved_bytes(lv, 0, segments) for lv in ("full", "keep_attn", "mlp", "mlp_act")}
    assert saved["full"] > saved["keep_attn"] > saved["mlp"] > saved["mlp_act"] > 0
    assert saved["full"] == cost.acts.unit_checkpoint_saving(0, segments)
    # keep_attn keeps the attention output (bf16) and a float32 log-sum-exp per head and token.
    assert saved["full"] - saved["keep_attn"] == pytest.approx(4096 * (4096 * 2 + 32 * 4), rel=1e-12)
    with pytest.raises(ValueError, match="unknown checkpoint level 'attn'"):
        check_levels(["attn"])
    assert check_levels(["mlp_act", "mlp"]) == ("mlp", "mlp_act")
    assert check_levels(["mlp_act", "keep_attn", "mlp"]) == FINER_LEVELS


def test_checkpoint_mix_layer_order_and_errors():
    assert CheckpointMix(1, 2, 1).layer_levels(5) == ["full", "mlp", "mlp", "mlp_act", None]
    assert CheckpointMix(1, 1, 1, 2).layer_levels(6) == ["full", "keep_attn", "keep_attn", "mlp", "mlp_act", None]
    with pytest.raises(ValueError, match="full \\+ keep_attn \\+ mlp \\+ mlp_act must be at most"):
        CheckpointMix(1, 2, 1).layer_levels(3)
    assert CheckpointMix.of(1, {"keep_attn": 2}) == CheckpointMix(1, keep_attn=2)
    with pytest.raises(ValueError, match="non-negative int"):
        CheckpointMix(0, -1, 0)
    assert CheckpointMix.of(2, {"mlp_act": 3}) == CheckpointMix(2, 0, 3)


def _plan_with_levels():
    plan = epp_plan([900, 300, 200, 150], 2, 400, 400)
    plan.layers_per_stage = [2, 2]
    plan.checkpoint_layers = {0: {0: 1}, 1: {0: 0}}
    plan.checkpoint_levels = {0: {0: {"mlp_act": 1}, 1: {"mlp": 2}}, 1: {2: {"mlp": 1, "mlp_act": 1},
                                                                         3: {"keep_attn": 1, "mlp": 1}}}
    return plan


def test_plan_json_round_trip_with_levels_and_old_json_loads():
    plan = _plan_with_levels()
    d = plan.to_dict()
    assert d["checkpoint_levels"] == {"0": {"0": {"mlp_act": 1}, "1": {"mlp": 2}},
                                      "1": {"2": {"mlp": 1, "mlp_act": 1}, "3": {"keep_attn": 1, "mlp": 1}}}
    assert d["checkpoint_layers"]["0"] == {"0": 1}  # whole layers keep their meaning
    back = Plan.from_json(plan.to_json())
    assert back.to_dict() == d
    assert back.checkpoint_mix(0, 0) == CheckpointMix(1, 0, 1) and back.checkpoint_mix(1, 4) == CheckpointMix()
    assert back.checkpoint_mix(1, 3) == CheckpointMix(0, 1, 0, 1)
    old = json.loads(plan.to_json())
    del old["checkpoint_levels"]
    assert Plan.from_dict(old).checkpoint_levels == {}
    # No finer level, no key: plans without levels serialise exactly as before.
    plan.checkpoint_levels = {0: {1: {"mlp": 0}}}
    assert "checkpoint_levels" not in plan.to_dict()
    assert "F0(c1+a1)" in str(_plan_with_levels()) and "F3(k1+m1)" in str(_plan_with_levels())


@pytest.mark.parametrize("levels, match", [
    ({0: {1: {"mlp": 3}}}, "= 3 checkpointed layers, but the stage has 2"),
    ({0: {0: {"mlp": 1, "mlp_act": 1}}}, "1 whole \\+ 1 mlp \\+ 1 mlp_act = 3"),
    ({0: {1: {"attention": 1}}}, "unknown level\\(s\\) \\['attention'\\]"),
    ({1: {2: {"mlp_act": -1}}}, "non-negative ints"),
    ({5: {0: {"mlp": 1}}}, "names stage 5"),
    ({0: {99: {"mlp": 1}}}, "names unit 99"),
])
def test_validator_rejects_bad_levels(levels, match):
    plan = _plan_with_levels()
    validate(plan)
    plan.checkpoint_levels = levels
    with pytest.raises(PlanValidationError, match=match):
        validate(plan)


def test_simulator_and_memory_count_levels():
    plan = _plan_with_levels()
    spec = dataclasses.replace(TINY, num_layers=4)
    cost = CostModel(spec, dims=ParallelDims(pp_degree=2), layers_per_stage=[2, 2])
    sim = simulate(plan, cost)
    shapes = {u.id: UnitShape.of(u.segments) for u in plan.units}
    want = sum(cost.levels.recompute_time(s, shapes[u.id], plan.checkpoint_mix(s, u.id))
               for s in range(2) for u in plan.units)
    assert sim.recompute_time_s == pytest.approx(want, rel=1e-12)
    assert sim.recompute_fraction == pytest.approx(want / (sim.step_time_s * 2), rel=1e-12)
    finer = sum(cost.levels.finer_recompute_s(shapes[u], CheckpointMix.of(0, c))
                for per in plan.checkpoint_levels.values() for u, c in per.items())
    plain = dataclasses.replace(plan, checkpoint_levels={})
    plain.__dict__.pop("unit_by_id", None)
    assert simulate(plain, cost).recompute_time_s == pytest.approx(want - finer, rel=1e-12)
    lower = []
    for s in range(2):
        with_levels = stage_peak_bytes(plan, cost, 0, s)
        without = stage_peak_bytes(plain, cost, 0, s)
        assert with_levels <= without
        lower.append(with_levels < without)
        assert sim.peak_memory_bytes[s] == pytest.approx(with_levels, rel=1e-12)
    assert any(lower)


LLAMA_7B = ModelSpec("llama", 32, 4096, 11008, 32, 32, 128, 32000, False)
LONG_TAILED = [40000, 9000, 3000, 2500, 1200, 800, 700, 400, 300, 120] * 6
BUDGET = 60 * 2**30


def test_plan_step_levels_cut_recompute_and_info_stays_true():
    off = plan_step(LONG_TAILED, LLAMA_7B, ParallelDims(pp_degree=4), PlanOptions(checkpoint_levels=(), checkpoint_sharing="diagonal", memory_budget_bytes=BUDGET))
    on = plan_step(LONG_TAILED, LLAMA_7B, ParallelDims(pp_degree=4), PlanOptions(memory_budget_bytes=BUDGET))
    assert off.feasible and on.feasible
    assert not off.plan.checkpoint_levels and on.plan.checkpoint_levels
    assert off.simulation.recompute_time_s > 0
    assert on.simulation.recompute_time_s < off.simulation.recompute_time_s
    assert on.simulation.step_time_s <= 1.01 * off.simulation.step_time_s
    for res in (off, on):
        # The info describes the plan that is returned, after the final solve.
        assert res.plan.info["recompute_time_s"] == pytest.approx(res.simulation.recompute_time_s, rel=1e-9)
        validate(Plan.from_json(res.plan.to_json()), CostModel(LLAMA_7B, dims=ParallelDims(pp_degree=4), memory_budget_bytes=BUDGET))
        assert res.summary()["recompute_fraction"] == res.simulation.recompute_fraction
    with pytest.raises(ValueError, match="unknown checkpoint level"):
        plan_step(LONG_TAILED, LLAMA_7B, ParallelDims(pp_degree=4), PlanOptions(checkpoint_levels=("attention",)))
    with pytest.raises(ValueError, match="checkpoint_sharing='rows'"):
        plan_step(LONG_TAILED, LLAMA_7B, ParallelDims(pp_degree=4), PlanOptions(checkpoint_sharing="rows"))


@pytest.mark.parametrize("sp", [2, 4])
def test_levels_per_gpu_under_sequence_parallelism(sp):
    """The MLP is token-sharded: a level drops its elements for the tokens a GPU holds, and its
    recompute runs on those tokens (no all-to-all in the MLP)."""
    one, many = CostModel(LLAMA_7B, dims=ParallelDims(pp_degree=4)), CostModel(LLAMA_7B, dims=ParallelDims(pp_degree=4, sp_degree=sp))
    tokens = 8191
    mix = CheckpointMix(0, 3, 2)
    per_gpu = math.ceil(tokens / sp)
    want = per_gpu * (3 * 4 + 2 * 2) * 11008 * 2  # bf16 elements of the levels
    whole, gpu_whole = [Segment(0, 0, tokens)], [Segment(0, 0, per_gpu)]
    assert many.levels.finer_saved_bytes(0, whole, mix) == pytest.approx(want, rel=2e-3)
    assert many.levels.finer_saved_bytes(0, whole, mix) == pytest.approx(
        one.levels.finer_saved_bytes(0, gpu_whole, mix), rel=1e-12)
    # keep_attn keeps the head-sharded attention output of all tokens: a hidden state per GPU token.
    kept = many.levels.layer_saved_bytes("full", 0, whole) - many.levels.layer_saved_bytes("keep_attn", 0, whole)
    assert kept == pytest.approx(per_gpu * (4096 * 2 + 32 * 4), rel=1e-12)
    shape, gpu_shape = UnitShape(float(tokens * tokens), tokens), UnitShape(0.0, per_gpu)
    assert many.levels.layer_recompute_s("mlp_act", shape) == pytest.approx(
        one.levels.layer_recompute_s("mlp_act", gpu_shape), rel=1e-12)
    assert many.levels.layer_recompute_s("mlp", shape) < many.levels.layer_recompute_s("full", shape)
