"""Rank views of a plan with SP rounds: rank classes, one rank's units, rounds collapsed to steps."""
from infinipipe_hf.ir.actions import Action, parse_actions
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import collapse_rounds, has_sub_groups, rank_classes, rank_view, round_of
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.ir.units import Segment, Unit


def _plan(**kw) -> Plan:
    """sp 4: round 0 = unit 0 on all ranks, round 1 = unit 1 on ranks 0-1 and units 2, 3 on ranks 2, 3."""
    units = [Unit(0, (Segment(0, 0, 16),)), Unit(1, (Segment(1, 0, 8),)), Unit(2, (Segment(2, 0, 3),)),
             Unit(3, (Segment(3, 0, 2),))]
    acts = parse_actions("F0 F1 F2 F3 B0 B1 B2 B3")
    groups = {1: SubGroup(0, 2), 2: SubGroup(2, 1), 3: SubGroup(3, 1)}
    return Plan("epp", 1, 1, [16, 8, 3, 2], units, {0: [acts]}, {0: {}}, sp_degree=4, sp_groups=groups,
                rounds=[[0], [1, 2, 3]], **kw)


def test_rank_classes_merge_ranks_that_run_the_same_units():
    plan = _plan()
    assert has_sub_groups(plan)
    assert rank_classes(plan) == [0, 2, 3]  # ranks 0 and 1 run units 0 and 1 alike
    assert round_of(plan) == {0: 0, 1: 1, 2: 1, 3: 1}


def test_a_rank_view_holds_one_unit_per_round_and_no_rounds():
    view = rank_view(_plan(), 3)
    assert [str(a) for a in view.stage_actions(0, 0)] == ["F0", "F3", "B0", "B3"]
    assert view.rounds == [] and view.sp_groups[3] == SubGroup(3, 1) and not has_sub_groups(view)


def test_a_plan_without_sub_groups_is_its_own_view():
    plan = _plan()
    plain = Plan("epp", 1, 1, plan.sequences, plan.units, plan.actions, {0: {}}, sp_degree=4)
    assert rank_classes(plain) == [0] and rank_view(plain, 2) is plain and not has_sub_groups(plain)


def test_collapse_rounds_makes_one_step_per_round_and_direction():
    plan = _plan()
    steps = collapse_rounds(plan.stage_actions(0, 0), round_of(plan))
    assert [[str(a) for a in s] for s in steps] == [["F0"], ["F1", "F2", "F3"], ["B0"], ["B1", "B2", "B3"]]
    # a round split by another action is two steps (the validator rejects it)
    split = collapse_rounds(parse_actions("F1 F0 F2 F3"), round_of(plan))
    assert len(split) == 3 and split[-1] == [Action("F", 2), Action("F", 3)]
