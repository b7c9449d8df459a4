"""seq1f1b's slice balance knob (planner/schedules/seq1f1b.py): both balances are searched, shown in
the plan's info, validated, kept by the static setting, and the leaner one sets the length limit."""
import pytest

from benchmarks.lib.static_pipeline import static_pipeline_baseline
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.registry import SCHEDULES
from infinipipe_hf.planner.schedules.base import SearchState
from infinipipe_hf.planner.schedules.baseline import PackKnobs
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.simulate.simulator import simulate
from infinipipe_hf.planner.validate.validator import validate

SPEC = ModelSpec.from_json_file(config_path("llama2-7b"))
SEQ = SCHEDULES["seq1f1b"]
LENGTHS = [32768, 9000, 4000, 2500, 1200, 800, 300]


def _cost(**kw):
    return CostModel(SPEC, dims=ParallelDims(pp_degree=4), memory_budget_bytes=kw.pop("budget", 80 * GIB), **kw)


def test_candidates_try_both_balances_past_one_slice():
    cost = _cost()
    ctx = PipelineContext(LENGTHS, [list(range(len(LENGTHS)))], cost, "uniform", num_slices=[1, 4])
    knobs = [c.knobs for c in SEQ.candidates(ctx, SearchState())]
    assert {(k.num_slices, k.slice_balance) for k in knobs} == {(1, "tokens"), (4, "tokens"), (4, "compute")}
    assert list(PackKnobs(4096, 4, "compute").record()) == ["pack_tokens", "num_slices", "slice_balance"]
    assert PackKnobs.from_record({"pack_tokens": 8192, "num_slices": 4, "slice_balance": "compute",
                                  "feasible": True}) == PackKnobs(8192, 4, "compute")


@pytest.mark.parametrize("balance", ["tokens", "compute"])
def test_plans_of_either_balance_validate(balance):
    cost = _cost()
    replicas = [list(range(len(LENGTHS)))]
    plan = SEQ.plan(LENGTHS, replicas, cost, PackKnobs(32768, 8, balance), "uniform")
    validate(plan, cost)
    assert plan.info["slice_balance"] == balance and plan.info["num_slices"] == 8
    sizes = [u.num_tokens for u in plan.units[:8]]  # the micro-batch of the 32K sequence
    assert (sizes[0] > sizes[-1]) == (balance == "compute")


def test_search_keeps_the_faster_balance_and_shows_it():
    res = plan_step(LENGTHS, SPEC, ParallelDims(pp_degree=4), PlanOptions(schedule="seq1f1b", memory_budget_bytes=80 * GIB, num_slices=[4]))
    assert res.feasible
    validate(res.plan, _cost())
    by_balance = {c["slice_balance"]: c["step_time_s"] for c in res.candidates
                  if c.get("feasible") and c["pack_tokens"] == res.plan.info["pack_tokens"]}
    assert set(by_balance) == {"tokens", "compute"}
    assert res.plan.info["slice_balance"] == min(by_balance, key=by_balance.get)
    assert res.summary()["info"]["slice_balance"] in ("tokens", "compute")
    assert by_balance["compute"] < by_balance["tokens"]  # a 32K sequence in 4 slices: equal compute wins


def test_static_setting_fixes_one_balance():
    cost = _cost()
    batches = [LENGTHS, LENGTHS[::-1]]
    tuned = [plan_step(b, SPEC, ParallelDims(pp_degree=4), PlanOptions(schedule="seq1f1b", num_slices=[1, 4]), cost=cost) for b in batches]
    best = static_pipeline_baseline("seq1f1b", batches, tuned, cost, num_slices=4)
    assert best.feasible and best.knobs["num_slices"] == 4 and best.knobs["slice_balance"] in ("tokens", "compute")
    one = static_pipeline_baseline("seq1f1b", batches, tuned, cost, num_slices=1)
    assert one.feasible and one.knobs["slice_balance"] == "tokens"


def test_leanest_plan_takes_the_balance_with_the_lower_peak():
    cost = _cost()
    plan = SEQ.leanest_plan(cost, 65536, 64)
    peaks = {b: max(simulate(SEQ.plan([65536], [[0]], cost, PackKnobs(65536, 64, b), "full"), cost).peak_memory_bytes)
             for b in ("tokens", "compute")}
    assert plan.info["num_slices"] == 64
    assert max(simulate(plan, cost).peak_memory_bytes) == min(peaks.values())


def test_static_setting_that_cannot_replan_a_batch_is_skipped_not_raised():
    """A run's checkpoint count replanned on a batch whose uniform plan fits nowhere makes the
    setting unusable for the run (None), as a simulated overflow does, instead of ending the table."""
    from benchmarks.lib.static_pipeline import _run_times

    class Refuses:
        def plan(self, *args, **kwargs):
            raise ValueError("no uniform count fits")

    row = {"checkpoint_layers": 2, "step_time_s": 1.0, "pack_tokens": 65536}
    assert _run_times(Refuses(), [LENGTHS], [row], 3, _cost()) is None
    assert _run_times(Refuses(), [LENGTHS], [row], 2, _cost()) == [1.0]
