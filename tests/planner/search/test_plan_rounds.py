"""``plan_step`` with elastic SP rounds: on by default at sp > 1, a switch to turn them off, plans
that validate and simulate the same after JSON, never slower than whole-group SP, deterministic."""
import pytest

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import has_sub_groups
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.search.api import PlanOptions, plan_step, resolve_sp_rounds
from infinipipe_hf.planner.simulate.simulator import simulate
from infinipipe_hf.planner.validate.validator import validate

SPEC = ModelSpec.from_json_file(config_path("llama2-7b"))
BATCH = [60000, 21000, 9000] + [300 + (i * 977) % 5000 for i in range(90)]


def _plan(sp_rounds=None, sp=4, pp=2, shard="sp", budget=80, **kw):
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=pp, sp_degree=sp, shard=shard), memory_budget_bytes=budget * GIB)
    return plan_step(BATCH, SPEC, cost.dims, PlanOptions(sp_rounds=sp_rounds, **kw), cost=cost), cost


@pytest.fixture(scope="module")
def with_rounds():
    return _plan(checkpoint_levels=())


def test_rounds_are_on_by_default_at_sp_above_one_and_the_plan_validates(with_rounds):
    res, cost = with_rounds
    plan = res.plan
    assert has_sub_groups(plan) and plan.rounds
    info = plan.info["sp_rounds"]
    assert info["rounds"] == len(plan.rounds) and info["single_gpu_units"] > 0
    validate(plan, cost)
    again = Plan.from_json(plan.to_json())
    validate(again, cost)
    assert simulate(again, cost).step_time_s == res.simulation.step_time_s


def test_the_slices_of_a_sequence_never_split_across_sub_groups(with_rounds):
    plan = with_rounds[0].plan
    where: dict[int, set] = {}
    for u in plan.units:
        for s in u.segments:
            where.setdefault(s.seq, set()).add(plan.sub_group(u.id))
    assert all(len(g) == 1 for g in where.values())
    assert len([u for u in plan.units if 0 in u.seqs]) > 1  # sequence 0 is sliced


def test_rounds_never_lose_to_whole_group_sp(with_rounds):
    whole, _ = _plan(False, checkpoint_levels=())
    assert not whole.plan.rounds and not whole.plan.sp_groups and "sp_rounds" not in whole.plan.info
    assert with_rounds[0].summary()["tokens_per_s"] >= whole.summary()["tokens_per_s"]


def test_planning_with_rounds_is_deterministic(with_rounds):
    again, _ = _plan(checkpoint_levels=())
    a, b = with_rounds[0].plan.to_dict(), again.plan.to_dict()
    for d in (a, b):  # the final solve's method note depends on its wall-clock limit
        d["info"].pop("checkpoint_method", None), d["info"].pop("checkpoint_note", None)
    assert a == b


def test_sp_one_and_the_baselines_plan_without_rounds():
    res, _ = _plan(sp=1, pp=4, shard="none")
    assert not res.plan.rounds and "sp_rounds" not in res.plan.info
    base, _ = _plan(schedule="seq1f1b")
    assert not base.plan.rounds


def test_asking_for_rounds_where_they_cannot_run_is_a_clear_error():
    with pytest.raises(ValueError, match="sp_rounds=True .* sp_degree=1 gives a stage one rank"):
        _plan(True, sp=1, pp=4, shard="none")
    with pytest.raises(ValueError, match="runs every unit on the whole SP group"):
        _plan(True, schedule="seq1f1b")
    with pytest.raises(ValueError, match="power of two"):
        resolve_sp_rounds(True, 6)
    assert resolve_sp_rounds(None, 6) is False and resolve_sp_rounds(None, 1) is False
    assert resolve_sp_rounds(None, 8) is True and resolve_sp_rounds(None, 8, "gpipe") is False


def test_the_config_switch_defaults_on_and_errors_only_when_asked_at_sp_one():
    assert InfiniPipeConfig().sp_rounds is None  # sp 1: fine, nothing to do
    InfiniPipeConfig(sp_degree=2, sp_rounds=True)
    InfiniPipeConfig(sp_degree=2, sp_rounds=False)
    with pytest.raises(ValueError, match="sp_rounds=True .* sp_degree=1"):
        InfiniPipeConfig(sp_rounds=True)
    with pytest.raises(ValueError, match="True, False or None"):
        InfiniPipeConfig(sp_degree=2, sp_rounds="yes")
