"""Alternatives' plans as EPP candidates (``PlanOptions.adopt_rounds_of``, planner/search/adopted.py).

On a short-document batch where FlexSP's group solver packs its rounds a little better than EPP's
own search (Llama-2-7B on 8 GPUs of 80 GiB: EPP alone plans 0.9999x FlexSP), EPP with FlexSP's
rounds adopted plans exactly FlexSP's step: the same units, nothing recomputed, the same seconds.
"""
import pytest

from infinipipe_hf.config import InfiniPipeConfig, planning_budget
from infinipipe_hf.data import synthetic
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.batch.sub_groups import rounds_of_groups
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step
from infinipipe_hf.planner.validate.validator import validate

SPEC = ModelSpec.from_json_file(config_path("llama2-7b"))
BUDGET = planning_budget(80 * 2**30, 0.08, 2.0).budget_bytes
LAYOUT = ParallelDims(1, 8, 1, "sp", 8)


@pytest.fixture(scope="module")
def lengths():
    return synthetic.short_only(n=256, max_len=2048, seed=5)


@pytest.fixture(scope="module")
def flexsp(lengths):
    return plan_alternative(lengths, SPEC, "flexsp", world_size=8, memory_budget_bytes=BUDGET, gpus_per_node=8)


def _epp(lengths, **options):
    return plan_step(lengths, SPEC, LAYOUT, PlanOptions(memory_budget_bytes=BUDGET, **options))


def test_epp_with_flexsp_adopted_plans_flexsps_step(lengths, flexsp):
    own = _epp(lengths)
    adopted = _epp(lengths, adopt_rounds_of=("flexsp",))
    assert own.simulation.tokens_per_s < flexsp.simulation.tokens_per_s  # the case: EPP alone trails
    assert adopted.simulation.tokens_per_s >= flexsp.simulation.tokens_per_s * (1 - 1e-12)
    assert adopted.simulation.tokens_per_s > own.simulation.tokens_per_s
    tried = [c for c in adopted.candidates if c.get("adopted_rounds_of") == "flexsp"]
    assert len(tried) == 1 and tried[0]["feasible"]
    # The pick is FlexSP's rounds: each group a unit on its own sub-group, every sequence once.
    plan = adopted.plan
    want = sorted(sorted(sorted(g.seqs) for g in r) for r in flexsp.plan.rounds)
    got = sorted(sorted(sorted(plan.unit_by_id[u].seqs) for u in r) for r in plan.rounds)
    assert got == want
    assert adopted.simulation.recompute_time_s == 0.0 == flexsp.simulation.recompute_time_s
    validate(plan, CostModel(SPEC, None, LAYOUT, memory_budget_bytes=BUDGET, grad_reduce=plan.grad_reduce))  # raises if not


def test_rounds_of_groups_cover_every_rank_and_refuse_what_sub_groups_cannot_run():
    lengths = [900, 700, 500, 300, 100]
    cost = CostModel(SPEC, None, ParallelDims(1, 4, 1, "sp", 8))
    rounded = rounds_of_groups([[(2, (0,)), (1, (1,))], [(4, (2, 3, 4))]], lengths, cost)
    assert [[u for u in r] for r in rounded.rounds] == [[0, 1], [2]]
    # The round left one rank free: its slowest unit that fits the gap doubled (1 -> 2 ranks).
    sizes = {u: rounded.sp_groups[u].size if u in rounded.sp_groups else 4 for r in rounded.rounds for u in r}
    assert sizes == {0: 2, 1: 2, 2: 4}
    assert rounds_of_groups([[(3, (0, 1, 2, 3, 4))]], lengths, cost) is None  # not a power of two
    assert rounds_of_groups([[(4, (0,)), (2, (1,))]], lengths, cost) is None  # more ranks than the group
    assert rounds_of_groups([[]], lengths, cost) is None


def test_adopt_rounds_of_needs_a_layout_holding_the_alternatives_plans(lengths):
    with pytest.raises(ValueError, match="pp_degree=1 and dp_degree=1"):
        plan_step(lengths, SPEC, ParallelDims(2, 4, 1, "sp", 8),
                  PlanOptions(memory_budget_bytes=BUDGET, adopt_rounds_of=("flexsp",)))
    with pytest.raises(ValueError, match="'dp' is not a non-pipeline alternative"):
        PlanOptions(adopt_rounds_of=("flexsp", "dp"))
    with pytest.raises(ValueError, match="not a non-pipeline alternative"):
        InfiniPipeConfig(adopt_rounds_of=("epp",))


def test_ring_cp_across_gpus_is_not_adopted(lengths):
    """Ring attention over several GPUs is not EPP's SP (Ulysses): such a plan is left out."""
    from infinipipe_hf.planner.search.adopted import adopted_rounds

    cost = CostModel(SPEC, None, LAYOUT, memory_budget_bytes=BUDGET)
    got = dict(adopted_rounds(lengths[:64], SPEC, cost, PlanOptions(adopt_rounds_of=("ring-cp", "flexsp")), True))
    ring = plan_alternative(lengths[:64], SPEC, "ring-cp", world_size=8, memory_budget_bytes=BUDGET, gpus_per_node=8)
    assert ("ring-cp" in got) == all(g.gpus == 1 for r in ring.plan.rounds for g in r)
    assert "flexsp" in got
