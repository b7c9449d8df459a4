"""Validator: a good plan passes; every kind of corrupted plan is rejected with the marked grid."""
import re

import pytest

from infinipipe_hf.ir.actions import B, F
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.actions import backward_order, build_pipeline_actions, epp_warmup
from infinipipe_hf.planner.validate.validator import PlanValidationError, validate

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
LENGTHS = [3000, 800, 400, 400, 200, 500]


def _cost(budget=80 * 2**30):
    return CostModel(ModelSpec.from_config_dict(LLAMA3_8B), dims=ParallelDims(pp_degree=4), memory_budget_bytes=budget)


def _units():
    return [Unit(0, (Segment(0, 0, 1200),)), Unit(1, (Segment(0, 1200, 2200),)),
            Unit(2, (Segment(0, 2200, 3000), Segment(3, 0, 400))), Unit(3, (Segment(1, 0, 800),)),
            Unit(4, (Segment(2, 0, 400), Segment(4, 0, 200))), Unit(5, (Segment(5, 0, 500),))]


def _plan(units=None):
    units = units or _units()
    acts = build_pipeline_actions([u.id for u in units], backward_order(units, LENGTHS), epp_warmup(ParallelDims(4), 3))
    return Plan("epp", 4, 1, list(LENGTHS), units, {0: acts}, {0: {0: 2}}, [8, 8, 8, 8])


def _reject(plan, match, **kw):
    with pytest.raises(PlanValidationError, match=match) as info:
        validate(plan, kw.pop("cost", None), **kw)
    text = str(info.value)
    assert "stage-by-time grid" in text, text
    assert re.search(r"\[[FB]\d+\]!", text), text  # the culprit is marked
    return info.value


def test_good_plan_passes():
    validate(_plan(), _cost(), max_tokens_per_unit=1200)


def test_drop_a_token():
    units = _units()
    units[1] = Unit(1, (Segment(0, 1200, 2199),))
    _reject(_plan(units), r"tokens \[2199, 2200\) of sequence 0 are in no segment")


def test_duplicate_a_segment():
    units = _units()
    units[5] = Unit(5, (Segment(5, 0, 500), Segment(2, 0, 400)))
    _reject(_plan(units), "in two segments")


def test_swap_slice_order():
    plan = _plan()
    for stage in plan.actions[0]:  # consistently on every stage, so only slice order is wrong
        i, j = stage.index(F(0)), stage.index(F(1))
        stage[i], stage[j] = stage[j], stage[i]
    err = _reject(plan, "slices must run forward in order")
    assert "[F1]!" in str(err)


def test_swap_backward_slice_order():
    plan = _plan()
    for stage in plan.actions[0]:
        i, j = stage.index(B(2)), stage.index(B(1))
        stage[i], stage[j] = stage[j], stage[i]
    _reject(plan, "last slice first")


def test_missing_action():
    plan = _plan()
    plan.actions[0][2].remove(B(4))
    err = _reject(plan, "stage 2 of dp replica 0 never runs B4")
    assert "[F4]!" in str(err)


def test_forward_order_mismatch_between_stages():
    plan = _plan()
    s1 = plan.actions[0][1]
    i, j = s1.index(F(4)), s1.index(F(5))
    s1[i], s1[j] = s1[j], s1[i]
    _reject(plan, "different orders")


def test_deadlock_creating_reorder():
    plan = _plan()
    # Same F and B orders on every stage (pairing holds), but stage 0 now waits for B3 before
    # sending F4, while stages 1-3 need F4 before they run B3.
    plan.actions[0][0][:] = [F(0), F(1), F(2), F(3), B(2), B(1), B(0), B(3), F(4), F(5), B(4), B(5)]
    for s in (1, 2, 3):
        plan.actions[0][s][:] = [F(0), F(1), F(2), F(3), B(2), B(1), B(0), F(4), B(3), F(5), B(4), B(5)]
    err = _reject(plan, "deadlocks")
    assert "never ran" in str(err) and "[B3]!" in str(err) and "[F4]!" in str(err)


def test_two_tail_slices_in_one_unit():
    lengths = [20, 20]
    units = [Unit(0, (Segment(0, 0, 10),)), Unit(1, (Segment(1, 0, 10),)),
             Unit(2, (Segment(0, 10, 20), Segment(1, 10, 20)))]
    acts = build_pipeline_actions([0, 1, 2], backward_order(units, lengths), epp_warmup(ParallelDims(2), 2))
    plan = Plan("epp", 2, 1, lengths, units, {0: acts}, {}, [4, 4])
    _reject(plan, "at most one tail slice")
    plan.schedule = "seq1f1b"  # the rule is EPP's only
    validate(plan)


def test_checkpoint_count_over_layers():
    plan = _plan()
    plan.checkpoint_layers = {2: {3: 9}}
    err = _reject(plan, "checkpoints 9 layers of unit 3, outside")
    assert "[B3]!" in str(err)


def test_memory_over_budget():
    plan = _plan()
    err = _reject(plan, "over the budget", cost=_cost(budget=20 * 2**30))
    assert err.dp_rank == 0 and err.marks
    validate(plan, _cost(budget=20 * 2**30), check_memory=False)


def test_token_budget_and_foreign_units():
    _reject(_plan(), "over the token budget", max_tokens_per_unit=1000)
    plan = _plan()
    plan.actions[0][3].append(F(9))
    _reject(plan, "not a unit of the plan")


def test_sequence_split_across_pipelines():
    units = _units()
    units[1] = Unit(1, (Segment(0, 1200, 2200),), pipeline=1)
    _reject(_plan(units), "split across")


def test_grid_window_on_a_big_plan():
    n = 200
    units = [Unit(i, (Segment(i, 0, 10),)) for i in range(n)]
    acts = build_pipeline_actions(range(n), range(n), epp_warmup(ParallelDims(4), 1))
    plan = Plan("packed-1f1b", 4, 1, [10] * n, units, {0: acts}, {}, [8] * 4)
    validate(plan)
    plan.checkpoint_layers = {1: {150: 99}}
    err = _reject(plan, "unit 150")
    assert "earlier slots not shown" in str(err) and len(str(err).splitlines()[2]) < 300
