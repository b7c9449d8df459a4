"""plan_step end to end: every schedule gives a valid plan; bad input gives clear errors."""

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.registry import PIPELINE_SCHEDULES as SCHEDULES
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.search.limits import largest_trainable_length
from infinipipe_hf.planner.validate.validator import validate

LLAMA_7B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
SPEC = ModelSpec.from_config_dict(LLAMA_7B)
LONG_TAILED = [40000, 9000, 3000, 2500, 1200, 800, 700, 400, 300, 120] * 3


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_plans_and_validates(schedule):
    res = plan_step(LONG_TAILED, SPEC, ParallelDims(pp_degree=4), PlanOptions(schedule=schedule))
    assert res.feasible, res.error
    plan = Plan.from_json(res.plan.to_json())  # the JSON round trip is the runtime's input
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=4))
    validate(plan, cost)
    d = res.summary()
    for key in ("schedule", "feasible", "step_time_s", "tokens_per_s", "bubble_fraction", "peak_memory_bytes",
                "memory_budget_bytes", "recompute_time_s", "num_pipelines", "num_units", "num_tokens",
                "planning_time_s"):
        assert key in d
    assert d["num_tokens"] == sum(LONG_TAILED)
    assert max(d["peak_memory_bytes"]) <= d["memory_budget_bytes"]
    assert len(d["peak_memory_bytes"]) == 4


def test_epp_slices_long_and_packs_short():
    res = plan_step(LONG_TAILED, SPEC, ParallelDims(pp_degree=4), PlanOptions(schedule="epp", memory_budget_bytes=60 * GIB))
    kinds = {u.kind(res.plan.sequences).value for u in res.plan.units}
    assert "slice" in kinds and ("packed" in kinds or "hybrid" in kinds)


def test_epp_not_slower_than_baselines_on_short_batch():
    short = [512, 700, 900, 1500, 2000, 300, 1024, 1800] * 16
    results = {s: plan_step(short, SPEC, ParallelDims(pp_degree=4), PlanOptions(schedule=s)).summary()["tokens_per_s"] for s in SCHEDULES}
    best_base = max(v for s, v in results.items() if s != "epp")
    assert results["epp"] >= 0.98 * best_base, results


def test_dp_assignment_balances_replicas():
    res = plan_step(LONG_TAILED, SPEC, ParallelDims(pp_degree=2, dp_degree=2), PlanOptions(schedule="epp"))
    assert res.feasible
    assert {u.dp_rank for u in res.plan.units} == {0, 1}
    assert set(res.plan.actions) == {0, 1}


@pytest.mark.parametrize("lengths, match", [
    ([], "empty batch"),
    ([10, 0, 5], "sequence 1 has length 0"),
])
def test_bad_batches(lengths, match):
    with pytest.raises(ValueError, match=match):
        plan_step(lengths, SPEC, ParallelDims(pp_degree=2))


def test_pp_larger_than_layers():
    with pytest.raises(ValueError, match="pp_degree=64 exceeds the model's 32 decoder layers"):
        plan_step([100], SPEC, ParallelDims(pp_degree=64))


def test_unknown_schedule():
    with pytest.raises(ValueError, match="schedule='zb1p' is not known"):
        plan_step([100], SPEC, ParallelDims(pp_degree=2), PlanOptions(schedule="zb1p"))


def test_sequence_too_long_names_length_and_limit():
    budget = 40 * GIB
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=4), memory_budget_bytes=budget)
    limit = largest_trainable_length(cost)
    assert 0 < limit < 10_000_000
    res = plan_step([limit * 2, 100], SPEC, ParallelDims(pp_degree=4), PlanOptions(memory_budget_bytes=budget))
    assert not res.feasible
    assert f"{limit * 2} tokens" in res.error and f"the largest that fits is {limit} tokens" in res.error
    assert plan_step([limit, 100], SPEC, ParallelDims(pp_degree=4), PlanOptions(memory_budget_bytes=budget)).feasible


def test_baselines_respect_max_tokens_per_unit_or_say_why():
    from infinipipe_hf.planner.search.api import plan_step

    lengths = [3000, 700, 300, 90, 40]
    sliced = plan_step(lengths, SPEC, ParallelDims(pp_degree=2), PlanOptions(schedule="seq1f1b", max_tokens_per_unit=512))
    assert sliced.feasible and max(u.num_tokens for u in sliced.plan.units) <= 512
    packed = plan_step(lengths, SPEC, ParallelDims(pp_degree=2), PlanOptions(schedule="packed-1f1b", max_tokens_per_unit=512))
    assert not packed.feasible
    assert "max_tokens_per_unit=512" in packed.error and "3000" in packed.error
