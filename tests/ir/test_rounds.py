"""SP sub-groups and rounds: alignment checks, coverage checks, and the plan's JSON round trip."""
import pytest

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.ir.units import Segment, Unit


@pytest.mark.parametrize("offset, size", [(0, 8), (4, 4), (6, 2), (7, 1)])
def test_aligned_sub_groups_pass(offset, size):
    _plan(sp_degree=8).check_sub_group(SubGroup(offset, size))


@pytest.mark.parametrize("offset, size", [(2, 4), (0, 3), (8, 1), (0, 16), (-1, 1)])
def test_unaligned_sub_groups_fail_with_the_valid_sizes(offset, size):
    with pytest.raises(ValueError, match=r"the size must be one of \[1, 2, 4, 8\]"):
        _plan(sp_degree=8).check_sub_group(SubGroup(offset, size))


def test_rounds_must_partition_the_sp_ranks():
    groups = {0: SubGroup(0, 2), 1: SubGroup(2, 1), 2: SubGroup(3, 1)}

    def check(rounds, num_units):
        units = [Unit(i, (Segment(i, 0, 1),)) for i in range(num_units)]
        Plan("epp", 1, 1, [1] * num_units, units, {0: [[]]}, {}, sp_degree=4, sp_groups=groups,
             rounds=rounds).check_rounds()

    check([[0, 1, 2], [3]], 4)  # unit 3: the whole group
    with pytest.raises(ValueError, match="covers SP ranks"):
        check([[0, 1]], 2)
    with pytest.raises(ValueError, match="is in round 0 and round 1"):
        check([[0, 1, 2], [0, 1, 2]], 3)
    with pytest.raises(ValueError, match="in no round"):
        check([[0, 1, 2]], 4)
    with pytest.raises(ValueError, match="does not have"):
        check([[0, 1, 2, 9]], 3)


def _plan(**kw) -> Plan:
    units = [Unit(0, (Segment(0, 0, 8),)), Unit(1, (Segment(1, 0, 3),)), Unit(2, (Segment(2, 0, 2),))]
    acts = [Action.parse(a) for a in ("F0", "F1", "F2", "B0", "B1", "B2")]
    return Plan("epp", 1, 1, [8, 3, 2], units, {0: [acts]}, {0: {}}, **{"sp_degree": 2, **kw})


def test_plan_without_sub_groups_runs_every_unit_on_the_whole_group():
    plan = _plan()
    assert plan.sub_group(1) == SubGroup(0, 2) and plan.runs_on(1, 0) and plan.runs_on(1, 1)
    d = plan.to_dict()
    assert "sp_groups" not in d and "rounds" not in d  # the contract's plan JSON is unchanged


def test_plan_with_rounds_round_trips_through_json():
    plan = _plan(sp_groups={1: SubGroup(0, 1), 2: SubGroup(1, 1)}, rounds=[[0], [1, 2]])
    assert plan.runs_on(1, 0) and not plan.runs_on(1, 1) and plan.runs_on(2, 1)
    d = plan.to_dict()
    assert d["sp_groups"] == {"1": [0, 1], "2": [1, 1]} and d["rounds"] == [[0], [1, 2]]
    back = Plan.from_json(plan.to_json())
    assert back.sp_groups == plan.sp_groups and back.rounds == plan.rounds and back.to_dict() == d
