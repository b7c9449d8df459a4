"""Planning with sequence parallelism and sharded states: units, search grids, plan JSON, checks."""
import json

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.pipeline.grids import (
    packing_candidates,
    slice_count_candidates,
    slicing_candidates,
    token_floor_candidates,
)
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.search.limits import largest_trainable_length
from infinipipe_hf.planner.simulate.simulator import simulate
from infinipipe_hf.planner.validate.validator import PlanValidationError, validate

SPEC = ModelSpec.from_json_file(config_path("llama2-7b"))
BATCH = [120000, 40000, 9000, 3000, 2500, 1200, 800, 700, 400, 300, 120] * 3


def test_a_stage_of_more_gpus_holds_longer_units():
    budget = 52 * GIB  # four stages of one GPU do not fit the batch; of two or eight they do
    assert not plan_step(BATCH, SPEC, ParallelDims(pp_degree=4), PlanOptions(memory_budget_bytes=budget)).feasible
    two = plan_step(BATCH, SPEC, ParallelDims(pp_degree=4, sp_degree=2), PlanOptions(memory_budget_bytes=budget))
    eight = plan_step(BATCH, SPEC, ParallelDims(pp_degree=4, sp_degree=8), PlanOptions(memory_budget_bytes=budget))
    assert two.feasible and eight.feasible
    assert eight.plan.info["num_slices"] < two.plan.info["num_slices"]
    assert eight.plan.info["token_budget"][0] > 2 * two.plan.info["token_budget"][0]
    assert eight.summary()["tokens_per_s"] > 3 * two.summary()["tokens_per_s"]  # 4x the GPUs
    for res, sp in ((two, 2), (eight, 8)):
        assert res.plan.sp_degree == sp and res.summary()["sp_degree"] == sp
        validate(res.plan, CostModel(SPEC, dims=ParallelDims(pp_degree=4, sp_degree=sp), memory_budget_bytes=budget))
        assert max(res.simulation.peak_memory_bytes) <= budget


def test_every_schedule_plans_with_the_same_sp_and_shard():
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=4, sp_degree=8, shard="sp"))
    for schedule in ("epp", "seq1f1b", "packed-1f1b", "gpipe"):
        res = plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4, sp_degree=8, shard="sp"), PlanOptions(schedule=schedule), cost=cost)
        assert res.summary()["shard"] == "sp" and res.summary()["sp_degree"] == 8
        if res.feasible:
            assert (res.plan.sp_degree, res.plan.shard.name) == (8, "sp")
            assert res.simulation.info["gradient_sync_s"] > 0  # the step's reduce-scatter shows


def test_plan_json_keys_and_round_trip():
    res = plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4, sp_degree=8, shard="sp"))
    d = json.loads(res.plan.to_json())
    assert d["sp_degree"] == 8 and d["shard"] == "sp"
    back = Plan.from_json(res.plan.to_json())
    assert (back.sp_degree, back.shard.name) == (8, "sp") and back.to_dict() == d
    assert "sp=8 shard=sp" in str(back)
    # Defaults are not written, and a JSON without the keys reads back with them.
    plain = plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4)).plan.to_dict()
    assert "sp_degree" not in plain and "shard" not in plain
    old = Plan.from_dict(plain)
    assert (old.sp_degree, old.shard.name) == (1, "none")


def test_layout_mismatches_are_errors():
    res = plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4, sp_degree=8))
    other = CostModel(SPEC, dims=ParallelDims(pp_degree=4, sp_degree=4))
    with pytest.raises(PlanValidationError, match="sp_degree=8, shard='none' but the cost model for sp_degree=4"):
        validate(res.plan, other)
    with pytest.raises(ValueError, match="build the CostModel on the plan's layout"):
        simulate(res.plan, other)
    with pytest.raises(ValueError, match=r"built for pp 4 x sp 4 x dp 1, shard none .*, not pp 4 x sp 8"):
        plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4, sp_degree=8), cost=other)
    with pytest.raises(ValueError, match="exceeds the model's 32 attention heads"):
        plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4, sp_degree=33))
    with pytest.raises(ValueError, match="DP replicas, which has one rank"):
        plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4, sp_degree=2, shard="dp"))


def test_search_grids_count_tokens_per_gpu():
    lengths = [65536, 1000]
    sp1, sp8 = ParallelDims(), ParallelDims(sp_degree=8)
    assert slice_count_candidates(lengths, None, sp1)[-1] == 64
    assert slice_count_candidates(lengths, None, sp8)[-1] == 32  # 65536 / 32 = 2048 = 256 per GPU
    assert token_floor_candidates([3000] * 100, sp8) == [None, 32768, 65536, 131072]
    assert token_floor_candidates([3000] * 100, sp1) == [None, 4096, 8192, 16384]
    assert packing_candidates(lengths, 8)[0] == 65536 and min(packing_candidates([10] * 5000, 8)) == 8192
    assert min(packing_candidates([10] * 5000, 1)) == 1024
    assert slicing_candidates(lengths, sp8) == [1, 2, 4, 8, 16, 32]
    assert slicing_candidates(lengths, sp1) == [1, 2, 4, 8, 16, 32, 64]


def test_largest_trainable_length_per_schedule():
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=4, sp_degree=2), memory_budget_bytes=80 * GIB)
    epp = largest_trainable_length(cost)
    seq = largest_trainable_length(cost, schedule="seq1f1b")
    packed = largest_trainable_length(cost, schedule="packed-1f1b")
    assert min(epp, seq) > packed > 0  # slicing holds more
    assert epp >= seq * (1 - 1e-4)  # both cut 64 equal-time slices at the limit: the same up to rounding
    assert plan_step([packed], SPEC, ParallelDims(pp_degree=4, sp_degree=2), PlanOptions(schedule="packed-1f1b"), cost=cost).feasible
    assert not plan_step([packed + 1], SPEC, ParallelDims(pp_degree=4, sp_degree=2), PlanOptions(schedule="packed-1f1b"), cost=cost).feasible
    with pytest.raises(ValueError, match="schedule='zb1p' is not known"):
        largest_trainable_length(cost, schedule="zb1p")


def test_seq1f1b_takes_a_static_slice_count():
    for k in (2, 4):
        res = plan_step(BATCH[:11], SPEC, ParallelDims(pp_degree=4, sp_degree=8), PlanOptions(schedule="seq1f1b", num_slices=[k]))
        assert res.feasible and res.plan.info["num_slices"] == k
        assert {c["num_slices"] for c in res.candidates} == {k}
