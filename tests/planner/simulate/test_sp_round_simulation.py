"""Simulating a plan with SP rounds: a round lasts as long as its slowest unit, each unit priced on
its own sub-group (one GPU: no all-to-all), memory per rank."""
from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import rank_view
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.points import stage_peak_bytes
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.pipeline.actions import backward_order, build_pipeline_actions, epp_warmup
from infinipipe_hf.planner.simulate.simulator import simulate
from tests.planner.hand_plans import TINY

LENGTHS = [1000, 900, 200]


def round_plan(pp: int = 2, big: int = 900) -> Plan:
    """sp 2: sequence 0 sliced on the whole group (rounds 0, 1); round 2 runs sequence 1 on rank 0
    and sequence 2 on rank 1, each alone on its GPU."""
    lengths = [1000, big, 200]
    units = [Unit(0, (Segment(0, 0, 600),)), Unit(1, (Segment(0, 600, 1000),)),
             Unit(2, (Segment(1, 0, big),)), Unit(3, (Segment(2, 0, 200),))]
    items = [Unit(0, units[0].segments), Unit(1, units[1].segments), Unit(2, units[2].segments + units[3].segments)]
    members = {0: [0], 1: [1], 2: [2, 3]}
    stages = build_pipeline_actions([0, 1, 2], backward_order(items, lengths), epp_warmup(ParallelDims(pp), 2))
    actions = {0: [[Action(a.kind, u) for a in acts for u in members[a.unit]] for acts in stages]}
    return Plan("epp", pp, 1, lengths, units, actions, {s: {} for s in range(pp)}, [3] * pp if pp == 2 else [6],
                sp_degree=2, sp_groups={2: SubGroup(0, 1), 3: SubGroup(1, 1)}, rounds=[[0], [1], [2, 3]])


def _cost(pp=2) -> CostModel:
    return CostModel(TINY, dims=ParallelDims(pp_degree=pp, sp_degree=2), memory_budget_bytes=40 * GIB)


def test_a_single_gpu_unit_is_priced_with_no_all_to_all_and_the_round_waits_for_its_slowest():
    plan, cost = round_plan(), _cost()
    alone = CostModel(TINY, dims=ParallelDims(pp_degree=2, sp_degree=1), memory_budget_bytes=40 * GIB)
    sim = simulate(plan, cost)
    ev = {(e.stage, e.action): e for e in sim.events}
    for s in range(2):
        for u, seq in ((2, 900), (3, 200)):
            shape = UnitShape(float(seq * seq), seq)
            assert abs((ev[(s, f"F{u}")].end_s - ev[(s, f"F{u}")].start_s) - alone.compute.forward_time(s, shape)) < 1e-12
        assert ev[(s, "F2")].start_s == ev[(s, "F3")].start_s  # side by side
        assert ev[(s, "F3")].end_s < ev[(s, "F2")].end_s  # the short one idles until the round ends
    whole = UnitShape(600.0 * 600, 600)
    assert abs((ev[(0, "F0")].end_s - ev[(0, "F0")].start_s) - cost.compute.forward_time(0, whole)) < 1e-12


def test_busy_time_counts_each_unit_for_its_share_of_the_ranks():
    sim = simulate(round_plan(), _cost())
    busy = sum((e.end_s - e.start_s) * (0.5 if e.action[1:] in ("2", "3") else 1.0) for e in sim.events)
    assert abs(sim.bubble_fraction - (1 - busy / (sim.step_time_s * 2))) < 1e-9


def test_memory_is_the_busiest_ranks_and_a_single_gpu_unit_stays_on_its_rank():
    cost = _cost(pp=1)
    small, large = round_plan(pp=1, big=400), round_plan(pp=1, big=900)
    for plan in (small, large):
        per_rank = [stage_peak_bytes(rank_view(plan, r), cost, 0, 0, {}) for r in (0, 1)]
        assert simulate(plan, cost).peak_memory_bytes[0] == max(per_rank)
    # rank 1 runs the same units in both plans: sequence 1 (on rank 0 only) never reaches it
    assert (stage_peak_bytes(rank_view(small, 1), cost, 0, 0, {})
            == stage_peak_bytes(rank_view(large, 1), cost, 0, 0, {}))
    assert (stage_peak_bytes(rank_view(large, 0), cost, 0, 0, {})
            > stage_peak_bytes(rank_view(small, 0), cost, 0, 0, {}))


def test_group_round_cost_is_charged_once_per_unit_on_several_ranks_as_flexsp_pays_per_group():
    """Units 0 and 1 run on both SP ranks and pay ``group_round_s`` once over the step (spread over
    their forward and backward on both stages); units 2 and 3 run alone on one rank and pay nothing."""
    from dataclasses import replace

    from infinipipe_hf.planner.cost.calibration import Calibration
    from infinipipe_hf.planner.simulate.action_costs import ActionCosts

    plan, fixed = round_plan(), 0.01
    base = _cost()
    cal = CostModel(TINY, replace(base.profile, calibration=Calibration(group_round_s=fixed)), ParallelDims(pp_degree=2, sp_degree=2), memory_budget_bytes=40 * GIB)
    plain, charged = ActionCosts(plan, base), ActionCosts(plan, cal)
    for uid, pays in ((0, True), (1, True), (2, False), (3, False)):
        extra = sum(charged.unit_duration(s, Action(k, uid)) - plain.unit_duration(s, Action(k, uid))
                    for s in range(2) for k in "FB")
        assert abs(extra - (fixed if pays else 0.0)) < 1e-12, (uid, extra)
    assert simulate(plan, cal).step_time_s > simulate(plan, base).step_time_s + fixed
