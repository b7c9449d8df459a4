"""Plan, unit and action data: string and JSON round trips, classification, errors."""
import pytest

from infinipipe_hf.ir.actions import Action, ActionKind, B, F, format_actions, like, parse_actions
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit, UnitKind


def test_action_string_round_trip():
    acts = [F(0), F(12), B(12), B(0)]
    assert format_actions(acts) == "F0 F12 B12 B0"
    assert parse_actions(format_actions(acts)) == acts
    for a in acts:
        assert Action.parse(str(a)) == a


def test_actions_are_shared_values():
    """``F``/``B`` hand out one instance per unit; an action equals, hashes and copies as its
    kind and unit alone, and knows whether it is a forward however it was built."""
    assert F(7) is F(7) and B(7) is B(7) and F(7) != B(7)
    assert F(7) == Action("F", 7) == Action(ActionKind.FORWARD, 7) and hash(F(7)) == hash(Action("F", 7))
    assert F(7).is_forward and Action("F", 7).is_forward and not Action("B", 7).is_forward
    assert like(B(1), 9) is B(9) and like(F(1), 9) is F(9)
    assert repr(F(7)) == "Action(kind=<ActionKind.FORWARD: 'F'>, unit=7)"
    with pytest.raises(ValueError, match="unit id must be >= 0"):
        F(-1)


@pytest.mark.parametrize("bad", ["X1", "F", "Fx", "1F0", "", "F-1"])
def test_action_parse_rejects(bad):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad)


def test_unit_kinds():
    lengths = [10, 3, 4]
    assert Unit(0, (Segment(1, 0, 3), Segment(2, 0, 4))).kind(lengths) is UnitKind.PACKED
    assert Unit(1, (Segment(0, 0, 6),)).kind(lengths) is UnitKind.SLICE
    assert Unit(2, (Segment(0, 6, 10), Segment(1, 0, 3))).kind(lengths) is UnitKind.HYBRID
    assert Unit(3, (Segment(0, 0, 10),)).kind(lengths) is UnitKind.PACKED


def _plan():
    units = [Unit(0, (Segment(0, 0, 6),)), Unit(1, (Segment(0, 6, 10), Segment(1, 0, 3)))]
    actions = {0: [[F(0), F(1), B(1), B(0)], [F(0), B(0), F(1), B(1)]]}
    return Plan("epp", 2, 1, [10, 3], units, actions, {0: {0: 1, 1: 0}, 1: {0: 2}}, [2, 2],
                info={"num_slices": 2})


def test_plan_json_round_trip_and_contract_keys():
    plan = _plan()
    d = plan.to_dict()
    for key in ("schedule", "pp_degree", "dp_degree", "sequences", "units", "actions", "checkpoint_layers"):
        assert key in d
    assert d["actions"]["0"][0] == ["F0", "F1", "B1", "B0"]
    assert d["units"][1]["segments"] == [[0, 6, 10], [1, 0, 3]]
    assert d["checkpoint_layers"]["1"] == {"0": 2}
    back = Plan.from_json(plan.to_json())
    assert back.to_dict() == d
    assert back.checkpointed(1, 0) == 2 and back.checkpointed(1, 1) == 0


def test_plan_helpers():
    plan = _plan()
    assert plan.num_tokens == 13
    assert plan.num_pipelines == 1
    assert plan.continues_after(Segment(0, 0, 6)) and not plan.continues_after(Segment(0, 6, 10))
    text = str(plan)
    assert "stage1" in text and "F0(c2)" in text


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("units"), r"lacks the field 'units'"),
    (lambda d: d.update(pp_degree="two"), r"malformed \(ValueError: invalid literal"),
    (lambda d: d["actions"]["0"][0].append("X3"), r"malformed .*cannot parse action 'X3'"),
    (lambda d: d["units"][0].update(segments=[[0, 1]]), r"malformed"),
])
def test_plan_json_errors_name_what_is_wrong(edit, match):
    import json

    plan = Plan("epp", 1, 1, [4], [Unit(0, (Segment(0, 0, 4),))], {0: [[F(0), B(0)]]}, {0: {0: 0}})
    d = json.loads(plan.to_json())
    assert Plan.from_json(json.dumps(d)).to_json() == plan.to_json()
    edit(d)
    with pytest.raises(ValueError, match=match):
        Plan.from_json(json.dumps(d))
    with pytest.raises(ValueError, match="malformed"):
        Plan.from_json("{not json")
