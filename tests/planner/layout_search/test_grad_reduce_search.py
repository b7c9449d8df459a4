"""The layout search with per-unit gradient reduction: ``sp`` and ``hybrid`` share a pricing key,
but across DP replicas only ``sp`` can reduce per unit, so ``hybrid`` is planned on its own when
``sp``'s plan reduces per unit (and priced as ``sp`` when it reduces once per step)."""
import pytest

from infinipipe_hf.data import synthetic
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.layout_search.result import NoLayoutFits
from infinipipe_hf.planner.layout_search.search import search_layouts
from infinipipe_hf.planner.search.api import PlanOptions, plan_step

SPEC = ModelSpec.from_json_file(config_path("llama2-13b"))
LENGTHS = synthetic.short_only(n=64, max_len=2048, seed=1)
KW = dict(world_size=8, gpus_per_node=8, memory_budget_bytes=72 * GIB, sp_degrees=(4,), shards=("sp", "hybrid"),
          dp_degrees=(2,), alternatives=False, prune=False)


def _by_layout(search):
    return {o.layout: o for o in search.layouts}


def test_hybrid_is_planned_alone_when_sp_reduces_per_unit():
    by = _by_layout(search_layouts(LENGTHS, SPEC, **KW))
    sp, hybrid = by[ParallelDims(1, 4, 2, "sp", 8)], by[ParallelDims(1, 4, 2, "hybrid", 8)]
    assert sp.feasible and sp.result.plan.grad_reduce == "unit" and sp.to_dict()["grad_reduce"] == "unit"
    assert hybrid.priced_as is None and hybrid.result is not sp.result
    # Once per step, 13B's unsharded gradients do not fit beside the states: ruled out, not sp's plan.
    assert not hybrid.feasible and "model states alone" in hybrid.ruled_out


def test_hybrid_is_priced_as_sp_when_both_reduce_once_per_step():
    by = _by_layout(search_layouts(LENGTHS, ModelSpec.from_json_file(config_path("llama2-7b")),
                                   plan_options={"grad_reduce": "step"}, **KW))
    sp, hybrid = by[ParallelDims(1, 4, 2, "sp", 8)], by[ParallelDims(1, 4, 2, "hybrid", 8)]
    assert sp.feasible and hybrid.priced_as == "sp" and hybrid.result is sp.result


def test_largest_lengths_are_judged_with_the_leaner_per_unit_reduction():
    """With ``grad_reduce="auto"`` the search plans pp 1 x sp 8 sharded over SP reducing per unit,
    so the longest sequence it reports for that layout (and the no-fit message's) is per unit's:
    reducing once per step, 13B's unsharded gradients leave no room on 40 GiB GPUs at all."""
    budget = 40 * GIB * 0.92 - 2 * GIB  # the trainer's default budget on a 40 GiB GPU
    kw = dict(world_size=8, gpus_per_node=8, memory_budget_bytes=budget, sp_degrees=(8,), shards=("sp",),
              dp_degrees=(1,), alternatives=False)
    too_long = [112744] + [2048] * 7
    with pytest.raises(NoLayoutFits) as auto:
        search_layouts(too_long, SPEC, **kw)
    (outcome,) = auto.value.search.layouts
    assert 32768 < outcome.largest_trainable < 112744
    assert f"the largest any layout trains is {outcome.largest_trainable} (pp 1 x sp 8 x dp 1 shard sp)" in str(auto.value)
    # Planned at the length reported: one sequence of it fits, per unit.
    lay = ParallelDims(1, 8, 1, "sp", 8)
    assert plan_step([outcome.largest_trainable], SPEC, lay, PlanOptions(memory_budget_bytes=budget)).feasible
    with pytest.raises(NoLayoutFits) as step:
        search_layouts(too_long, SPEC, plan_options={"grad_reduce": "step"}, **kw)
    assert step.value.search.layouts[0].largest_trainable == 0
