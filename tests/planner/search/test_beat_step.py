"""``plan_step(beat_step_s=...)``: the search stops only where no plan could run under the caller's
step (its bound is at most the full search's step), and is exactly the full search otherwise.

The first bound replays every candidate the search may plan with nothing recomputed, the second
replays the planned finalists the same way; the layouts cover
pipelines, SP groups with rounds and both gradient reductions, sharding and a host tier, where
the finishing solve changes the checkpointing (and K/V stores) of the same units."""
import math
import types

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.search.grad_reduce import plan_each_reduce
from infinipipe_hf.planner.search.result import PlanResult

SPEC = ModelSpec.from_config_dict({
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 65536})
LONG_TAIL = [9000, 3000, 1200, 800, 500, 300, 200, 100, 64, 32]
SHORT = [512, 480, 400, 350, 300, 256, 200, 128, 100, 64, 50, 32]
CASES = {
    "pp1": (ParallelDims(1, 1, 1, gpus_per_node=8), 0.0, LONG_TAIL),
    "pp4": (ParallelDims(4, 1, 1, gpus_per_node=8), 0.0, LONG_TAIL),
    "pp2-dp2-shard-dp": (ParallelDims(2, 1, 2, "dp", gpus_per_node=8), 0.0, LONG_TAIL),
    "pp2-sp2-rounds": (ParallelDims(2, 2, 1, "sp", gpus_per_node=8), 0.0, LONG_TAIL + SHORT),
    "pp1-sp4-rounds": (ParallelDims(1, 4, 1, "sp", gpus_per_node=8), 0.0, LONG_TAIL + SHORT),
    "pp2-host": (ParallelDims(2, 1, 1, gpus_per_node=8, state_offload="optimizer"), 1.0, LONG_TAIL),
}


BUDGET = 0.3 * GIB


def _same(a, b) -> bool:
    """The same plan; ``grad_reduce_tried`` lists only the modes planned in full."""
    da, db = ({**d, "info": {k: v for k, v in d["info"].items() if k != "grad_reduce_tried"}}
              for d in (a.plan.to_dict(), b.plan.to_dict()))
    return da == db and a.simulation.step_time_s == b.simulation.step_time_s


@pytest.mark.parametrize("name", CASES)
def test_stopped_only_where_no_plan_runs_under_the_step_and_exact_otherwise(name):
    dims, host_gib, lengths = CASES[name]
    options = PlanOptions(memory_budget_bytes=BUDGET, host_memory_budget_bytes=host_gib * GIB)
    full = plan_step(lengths, SPEC, dims, options)
    assert full.feasible and full.simulation.recompute_time_s > 0, full.error  # the finishing solve has work
    step = full.simulation.step_time_s
    stopped = plan_step(lengths, SPEC, dims, options, beat_step_s=1e-9)
    assert not stopped.feasible and stopped.plan is None and "even without recompute" in stopped.error
    assert 0 < stopped.beaten_bound_s <= step  # the bound holds against the full search
    between = plan_step(lengths, SPEC, dims, options, beat_step_s=(stopped.beaten_bound_s + step) / 2)
    assert (between.beaten_bound_s is not None and between.beaten_bound_s <= step) or _same(between, full)
    for beat in (step * 1.000001, step * 1.5):  # a plan runs under it: planned in full
        got = plan_step(lengths, SPEC, dims, options, beat_step_s=beat)
        assert got.beaten_bound_s is None and _same(got, full)


def test_a_search_with_whole_sequence_candidates_is_stopped_only_after_planning_them():
    """One stage with a host tier also tries whole sequences with tiled MLPs (other units): no
    candidates' bound, but the finalists' (which holds them too) once every candidate is planned."""
    options = PlanOptions(memory_budget_bytes=BUDGET, host_memory_budget_bytes=1.0 * GIB)
    full = plan_step(LONG_TAIL, SPEC, ParallelDims(1, 1, 1, gpus_per_node=8), options)
    got = plan_step(LONG_TAIL, SPEC, ParallelDims(1, 1, 1, gpus_per_node=8), options, beat_step_s=1e-9)
    assert full.feasible and got.beaten_basis == "finalists" and 0 < got.beaten_bound_s <= full.simulation.step_time_s
    assert got.candidates == full.candidates  # every candidate planned, the final solve skipped


@pytest.mark.parametrize("name", CASES)
def test_the_finalists_bound_holds_and_stops_only_short_of_the_step(name, monkeypatch):
    """Without the candidates' bound the search plans its candidates and stops before the final
    solve where its finalists, replayed with nothing recomputed or copied, cannot run under the
    step; that bound is at most the full search's step, and a step it can beat is planned in full."""
    from infinipipe_hf.planner.schedules.epp import EPPSchedule

    dims, host_gib, lengths = CASES[name]
    options = PlanOptions(memory_budget_bytes=BUDGET, host_memory_budget_bytes=host_gib * GIB)
    full = plan_step(lengths, SPEC, dims, options)
    step = full.simulation.step_time_s
    monkeypatch.setattr(EPPSchedule, "candidates_bound", lambda self, ctx, below_s: None)
    stopped = plan_step(lengths, SPEC, dims, options, beat_step_s=1e-9)
    assert stopped.beaten_basis == "finalists" and 0 < stopped.beaten_bound_s <= step
    between = plan_step(lengths, SPEC, dims, options, beat_step_s=(stopped.beaten_bound_s + step) / 2)
    assert (between.beaten_bound_s is not None and between.beaten_bound_s <= step) or _same(between, full)
    got = plan_step(lengths, SPEC, dims, options, beat_step_s=step * 1.000001)
    assert got.beaten_bound_s is None and _same(got, full)


@pytest.mark.parametrize("name", ["pp2-sp2-rounds", "pp1-sp4-rounds"])
def test_auto_reduction_is_the_faster_of_the_two_planned_alone(name):
    """Sharded over SP, ``auto`` plans the per-unit reduction first and gives the per-step search
    that step: the pick is the faster of the two planned alone (the per-step one on a tie)."""
    dims, host_gib, lengths = CASES[name]
    alone = {mode: plan_step(lengths, SPEC, dims, PlanOptions(memory_budget_bytes=BUDGET, grad_reduce=mode))
             for mode in ("step", "unit")}
    auto = plan_step(lengths, SPEC, dims, PlanOptions(memory_budget_bytes=BUDGET))
    step, unit = (alone[m].simulation.step_time_s for m in ("step", "unit"))
    assert _same(auto, alone["unit"] if unit < step else alone["step"])


def _result(step_s: float | None = None, bound_s: float | None = None) -> PlanResult:
    sim = None if step_s is None else types.SimpleNamespace(step_time_s=step_s)
    plan = None if step_s is None else types.SimpleNamespace(info={})
    return PlanResult("epp", plan, sim, step_s is not None, None, 0.0, beaten_bound_s=bound_s)


@pytest.mark.parametrize("got, caller, want_beat, want", [
    ({"unit": (1.0, None), "step": (None, 1.2)}, None, math.nextafter(1.0, math.inf), ("unit", None)),
    ({"unit": (1.0, None), "step": (0.9, None)}, None, math.nextafter(1.0, math.inf), ("step", None)),
    ({"unit": (1.0, None), "step": (1.0, None)}, None, math.nextafter(1.0, math.inf), ("step", None)),
    ({"unit": (1.0, None), "step": (None, 0.6)}, 0.5, 0.5, ("step", 0.6)),
    ({"unit": (None, 0.7), "step": (None, 0.6)}, 0.5, 0.5, ("step", 0.6)),
])
def test_each_reduction_gets_the_step_to_beat_and_the_combination_is_the_full_searchs(got, caller, want_beat, want):
    """Per unit first; per step then runs under the per-unit step (kept only when strictly faster,
    the per-step plan on a tie as before) or the caller's, whichever is less.  A stopped mode only
    wins when nothing planned beats its bound, and then says the least bound of all."""
    beats = {}

    def plan_one(mode, cost, beat):
        beats[mode] = beat
        return _result(*got[mode])

    cost = PlanOptions(memory_budget_bytes=BUDGET).cost(SPEC, ParallelDims(1, 2, 1, "sp", gpus_per_node=8))
    best = plan_each_reduce(plan_one, cost, ("step", "unit"), 0.0, caller)
    assert list(beats) == ["unit", "step"] and beats["unit"] == caller and beats["step"] == want_beat
    mode, bound = want
    assert best is not None and best.beaten_bound_s == bound
    if bound is None:
        assert best.simulation.step_time_s == got[mode][0] and best.plan.info.get("grad_reduce_tried", {}) == (
            {m: got[m][0] for m in ("step", "unit")} if got["step"][0] is not None else {})
