"""The host copy lane: every action that copies gets an event whose exposed seconds are exactly what
its duration includes for the copies (checked against the same plan simulated with free copies),
the stage's end adds the optimizer tail's, no lane without a host tier, and lanes change no time."""
from __future__ import annotations

import dataclasses

import pytest

from infinipipe_hf.ir.levels import OFFLOAD
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.simulate import copy_lane
from infinipipe_hf.planner.simulate.simulator import simulate
from tests.planner.hand_plans import TINY, epp_plan

GIB = 2**30
FREE = 1e300
"""A host link and CPU so fast that every copy and host add takes no time."""


def cost_of(dims, layers, *, free=False, bandwidth=4e9, host=64 * GIB):
    p = dataclasses.replace(default_profile(), host_bandwidth_bytes_per_s=bandwidth)
    if free:
        p = dataclasses.replace(p, host_bandwidth_bytes_per_s=FREE, host_optimizer_params_per_s=FREE)
    spec = dataclasses.replace(TINY, num_layers=sum(layers))
    return CostModel(spec, p, dims, layers_per_stage=layers, memory_budget_bytes=1e18, host_budget_bytes=host)


def host_plan(pp=2, layers=(3, 3)):
    """Sliced and packed units; some units' layers offloaded, the last stage's KV store on the host."""
    plan = epp_plan([8192, 2048, 1024, 1024], pp, 2048, 2048)
    for s in range(pp):
        plan.checkpoint_levels[s] = {u.id: {OFFLOAD: layers[s] - (u.id % 2)} for u in plan.units if u.id != 1}
        plan.checkpoint_layers[s] = {u.id: u.id % 2 for u in plan.units if u.id != 1}
    plan.offload_kv = [pp - 1]
    return plan


def durations(sim):
    return {(e.dp_rank, e.stage, e.action): e.end_s - e.start_s for e in sim.events}


def assert_exposed_is_what_durations_include(plan, dims, layers):
    sim = simulate(plan, cost_of(dims, layers))
    free = simulate(plan, cost_of(dims, layers, free=True))
    with_copies, without = durations(sim), durations(free)
    lanes = {(e.dp_rank, e.stage, e.action): e for e in sim.copy_events if e.action != "step"}
    for key, d in with_copies.items():
        exposed = lanes[key].exposed_s if key in lanes else 0.0
        assert d - without[key] == pytest.approx(exposed, rel=1e-9, abs=1e-12), key
    total = sum(with_copies.values()) - sum(without.values())
    assert sum(e.exposed_s for e in lanes.values()) == pytest.approx(total, rel=1e-9)
    assert total > 0.01 * sum(without.values())  # the copies do show: the check is not vacuous
    return sim


def test_offloaded_inputs_and_kv_store_exposed_as_the_durations_include():
    plan = host_plan()
    sim = assert_exposed_is_what_durations_include(plan, ParallelDims(pp_degree=2), [3, 3])
    by = {(e.stage, e.action): e for e in sim.copy_events}
    assert not any(e.action == "step" for e in sim.copy_events)  # no state offload: no step tail
    assert by[(0, "F0")].sources == (OFFLOAD,) and by[(1, "F0")].sources == (OFFLOAD, "kv")
    assert (0, "F1") not in by and by[(1, "F1")].sources == ("kv",)  # unit 1 keeps its layers
    assert all(by[(0, f"F{u.id}")].exposed_s == 0.0 for u in plan.units if u.id != 1)  # charged to B
    assert by[(0, "B2")].exposed_s > 0
    # Bytes by hand: unit 2 (2048 tokens) offloads 3 - 0 layers' inputs on stage 0, each way.
    hidden = 2048 * TINY.hidden_size * default_profile().bytes_per_element
    assert by[(0, "F2")].bytes == pytest.approx(3 * hidden) == by[(0, "B2")].bytes
    assert by[(0, "F2")].copy_s == pytest.approx(3 * hidden / 4e9)
    assert by[(0, "F2")].end_s == pytest.approx(by[(0, "F2")].start_s + by[(0, "F2")].copy_s)
    d = sim.to_dict()
    assert d["host_copy_exposed_s"] == pytest.approx(sum(e.exposed_s for e in sim.copy_events))
    assert d["host_copy_s"] == pytest.approx(sim.host_copy_s) and d["host_copy_bytes"] > 0
    assert len(d["host_copy_s_per_stage"]) == 2 and min(d["host_copy_exposed_s_per_stage"]) > 0
    assert len(sim.to_dict(include_events=True)["copy_events"]) == len(sim.copy_events)


@pytest.mark.parametrize("mode", ["states", "optimizer"])
def test_state_offload_copies_and_the_optimizer_tail(mode):
    dims = ParallelDims(state_offload=mode)
    plan = epp_plan([8192, 2048, 1024], 1, 2048, 2048)
    cost = cost_of(dims, [6])
    sim = simulate(plan, cost) if mode == "optimizer" else assert_exposed_is_what_durations_include(plan, dims, [6])
    step = [e for e in sim.copy_events if e.action == "step"]
    assert len(step) == 1 and step[0].sources == ("step",)
    tail = cost.state_host.step_tail_s(0)
    assert step[0].exposed_s == tail > 0
    assert step[0].end_s == pytest.approx(sim.step_time_s)  # one stage of one GPU: the tail ends the step
    actions = [e for e in sim.copy_events if e.action != "step"]
    params = sum(cost.states.shard_numel[0])
    if mode == "optimizer":  # gradients down, weights up, AdamW on the CPU; nothing per action
        assert not actions
        assert step[0].bytes == pytest.approx(params * 8) and step[0].cpu_s == pytest.approx(params / 1e9)
        return
    assert len(actions) == 2 * len(plan.units) and all(e.sources == ("states",) for e in actions)
    f0, b0 = next(e for e in actions if e.action == "F0"), next(e for e in actions if e.action == "B0")
    assert f0.bytes == pytest.approx(4 * params) and b0.bytes == pytest.approx(8 * params)  # + gradients down
    assert f0.cpu_s == 0 and b0.cpu_s == pytest.approx(params / (1e9 * 28 / 12))  # the host add of the drain
    assert step[0].bytes == 0  # gradients are on the host already, weights fetched when they run


def test_no_host_tier_no_lane_and_no_new_keys():
    plan = epp_plan([8192, 2048, 1024, 1024], 2, 2048, 2048)
    sim = simulate(plan, cost_of(ParallelDims(pp_degree=2), [3, 3], host=0.0))
    assert sim.copy_events == [] and sim.host_copy_s == 0.0 == sim.host_copy_exposed_s
    assert not any(k.startswith("host_copy") or k == "copy_events" for k in sim.to_dict(include_events=True))
    result = plan_step([8192, 2048, 1024], TINY, ParallelDims(pp_degree=2), PlanOptions(memory_budget_bytes=GIB))
    assert result.feasible and result.simulation.copy_events == []
    assert not any(k.startswith("host_copy") for k in result.summary())


def test_lanes_change_no_time(monkeypatch):
    plan, dims = host_plan(), ParallelDims(pp_degree=2)
    sim = simulate(plan, cost_of(dims, [3, 3]))
    monkeypatch.setattr(copy_lane, "has_host_copies", lambda plan, cost: False)
    bare = simulate(plan, cost_of(dims, [3, 3]))
    assert sim.copy_events and not bare.copy_events
    keys = ("step_time_s", "bubble_fraction", "peak_memory_bytes", "recompute_time_s", "info")
    assert {k: sim.to_dict()[k] for k in keys} == {k: bare.to_dict()[k] for k in keys}
    assert sim.events == bare.events


def test_plan_step_with_a_host_budget_reports_its_copies():
    """A plan the planner offloads in: its summary carries the lane's totals, the exposed part
    within the step's busy time."""
    long = dataclasses.replace(TINY, max_position_embeddings=1 << 16)
    options = PlanOptions(memory_budget_bytes=0.45 * GIB, host_memory_budget_bytes=8 * GIB)
    result = plan_step([32768, 2048], long, ParallelDims(pp_degree=2), options)  # needs the host tier
    assert result.feasible, result.error
    plan, sim = result.plan, result.simulation
    offloads = any(per.get(OFFLOAD) for lv in plan.checkpoint_levels.values() for per in lv.values())
    assert offloads or plan.offload_kv, "the budget should force the host tier"
    summary = result.summary()
    assert summary["host_copy_s"] == pytest.approx(sim.host_copy_s) and sim.host_copy_s > 0
    assert 0 < summary["host_copy_exposed_s"] <= sum(e.end_s - e.start_s for e in sim.events)
    assert summary["host_copy_exposed_s_per_stage"] == sim.copy_totals()["host_copy_exposed_s_per_stage"]


def test_an_sp_rounds_copy_lane_is_its_busiest_gpus_not_the_sum_of_the_units_side_by_side():
    """Units 2 and 3 run side by side on SP ranks 0 and 1, each copying its own inputs: a stage's
    link seconds are one GPU's (whole-group units' plus its own round unit's), not both units'."""
    from tests.planner.simulate.test_sp_round_simulation import round_plan

    plan = round_plan(pp=1)
    plan.checkpoint_levels[0] = {u.id: {OFFLOAD: 6} for u in plan.units}
    cost = CostModel(dataclasses.replace(TINY, num_layers=6), default_profile(), ParallelDims(1, 2),
                     memory_budget_bytes=1e18, host_budget_bytes=64 * GIB)
    sim = simulate(plan, cost)
    by = {e.action: e for e in sim.copy_events}
    assert by["F2"].sub_group == (0, 1) and by["F3"].sub_group == (1, 1) and by["F0"].sub_group is None
    whole = sum(e.copy_s for e in sim.copy_events if e.sub_group is None)
    rank0, rank1 = whole + by["F2"].copy_s + by["B2"].copy_s, whole + by["F3"].copy_s + by["B3"].copy_s
    assert rank0 > rank1 > whole > 0  # unit 2 (900 tokens) copies more than unit 3 (200)
    totals = sim.copy_totals()
    assert totals["host_copy_s_per_stage"] == [pytest.approx(rank0)] and sim.host_copy_s == pytest.approx(rank0)
    assert sum(e.copy_s for e in sim.copy_events) > rank0  # the sum over units would overstate it
    lane = sim.copy_lanes()[(0, 0)]
    assert {e.action for e in lane} == {"F0", "F1", "F2", "B0", "B1", "B2"}
    assert totals["host_copy_bytes"] == pytest.approx(sum(e.bytes for e in lane))
