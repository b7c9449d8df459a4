"""The validator on plans with SP rounds: what the runtime relies on is checked, each with a clear message."""
from dataclasses import replace

import pytest

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.validate.validator import PlanValidationError, validate
from tests.planner.hand_plans import TINY
from tests.planner.simulate.test_sp_round_simulation import round_plan


def _cost() -> CostModel:
    return CostModel(TINY, dims=ParallelDims(pp_degree=2, sp_degree=2), memory_budget_bytes=40 * GIB)


def test_a_round_plan_validates_and_survives_json():
    plan = round_plan()
    validate(plan, _cost())
    validate(type(plan).from_json(plan.to_json()), _cost())


def test_rounds_need_more_than_one_rank_per_stage():
    plan = replace(round_plan(), sp_degree=1)
    with pytest.raises(PlanValidationError, match="sp_degree=1 gives a stage one rank"):
        validate(plan)


def test_a_round_must_cover_the_sp_ranks_once():
    plan = replace(round_plan(), sp_groups={2: SubGroup(0, 1), 3: SubGroup(0, 1)})
    with pytest.raises(PlanValidationError, match="covers SP ranks"):
        validate(plan, _cost())
    with pytest.raises(PlanValidationError, match="in no round"):
        validate(replace(round_plan(), rounds=[[0], [2, 3]]), _cost())


def test_the_slices_of_a_sequence_stay_on_one_sub_group():
    plan = round_plan()
    # sequence 0's second slice on rank 0 with sequence 2 on rank 1: its K/V would have to move
    plan = replace(plan, sp_groups={1: SubGroup(0, 1), 3: SubGroup(1, 1)}, rounds=[[0], [1, 3], [2]])
    with pytest.raises(PlanValidationError, match="sequence 0 runs on SP sub-group"):
        validate(plan)


def test_a_rounds_forwards_are_consecutive():
    plan = round_plan()
    acts = list(plan.actions[0][0])
    i, j = acts.index(Action("F", 2)), acts.index(Action("F", 3))
    acts.insert(j, acts.pop(next(k for k, a in enumerate(acts) if not a.is_forward and k > i)))
    with pytest.raises(PlanValidationError, match="splits the forwards of round 2") as err:
        validate(replace(plan, actions={0: [acts, plan.actions[0][1]]}), _cost())
    # the grid names the sub-group of every unit run on part of the stage's SP ranks
    g2, g3 = plan.sp_groups[2], plan.sp_groups[3]
    assert f"[F2@r{g2.offset}]!" in err.value.grid and f"F3@r{g3.offset}" in err.value.grid
    assert "F0@" not in err.value.grid and "a round's units run side by side" in err.value.grid


def test_a_rounds_units_share_one_checkpoint_mix():
    plan = round_plan()
    plan.checkpoint_layers = {0: {2: 1, 3: 0}, 1: {}}
    with pytest.raises(PlanValidationError, match="checkpoints the units of round 2 differently"):
        validate(plan, _cost())
    plan.checkpoint_layers = {0: {2: 1, 3: 1}, 1: {}}
    validate(plan, _cost())


def test_memory_is_checked_on_the_busiest_rank():
    plan = round_plan(big=900)
    cost = _cost()
    from infinipipe_hf.planner.simulate.simulator import simulate

    peak = max(simulate(plan, cost).peak_memory_bytes)
    tight = CostModel(TINY, dims=ParallelDims(pp_degree=2, sp_degree=2), memory_budget_bytes=peak - 1)
    with pytest.raises(PlanValidationError, match="over the budget"):
        validate(plan, tight)
    validate(plan, CostModel(TINY, dims=ParallelDims(pp_degree=2, sp_degree=2), memory_budget_bytes=peak))


def test_a_unit_in_no_round_may_not_use_a_sub_group():
    plan = replace(round_plan(), rounds=[])
    with pytest.raises(PlanValidationError, match="covers SP ranks"):
        validate(plan, _cost())
    validate(replace(round_plan(), rounds=[], sp_groups={}), _cost())  # every unit on the whole group
