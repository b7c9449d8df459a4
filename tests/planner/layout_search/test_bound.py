"""The layout search's step-time bound: below the step ``plan_step`` simulates on every layout, and
not vacuous (the pruning it allows is tested in test_prune.py)."""
import dataclasses

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.layout_search.bound import group_sizes, stage_coefficients, step_time_bound
from infinipipe_hf.planner.layout_search.search import SearchInputs, enumerate_layouts, pricing_key
from infinipipe_hf.planner.search.api import plan_step

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
SMALL = {**TINY, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 8192}
BATCHES = {
    "long-tail": [6000, 3000, 1200, 800, 500, 300, 200, 100],
    "one-long": [16000, 700, 600, 500, 400, 300, 200, 100, 90, 80],
    "short": [512, 480, 400, 350, 300, 256, 200, 128, 100, 64, 50, 32],
}
CASES = [("tiny", TINY, 4, 0.3), ("tiny", TINY, 4, 0.1), ("small", SMALL, 8, 1.0)]


def _layouts(spec, world):
    seen, out = set(), []
    for lay in enumerate_layouts(spec, world, world):
        if pricing_key(lay) not in seen:
            seen.add(pricing_key(lay))
            out.append(lay)
    return out


@pytest.mark.parametrize("name, config, world, budget_gib", CASES, ids=[f"{c[0]}-{c[2]}gpus-{c[3]}gib" for c in CASES])
def test_bound_is_below_the_planned_step_on_every_layout(name, config, world, budget_gib):
    spec = ModelSpec.from_config_dict(config)
    ratios = []
    for lengths in BATCHES.values():
        inputs = SearchInputs(lengths, spec, default_profile(), budget_gib * GIB, world, {})
        for lay in _layouts(spec, world):
            cost = inputs.cost(lay)
            bound = step_time_bound(lengths, cost)
            res = plan_step(lengths, spec, lay, inputs.options(lay), cost=cost)
            if not res.feasible:
                continue
            assert 0 < bound <= res.simulation.step_time_s, (lay, bound, res.simulation.step_time_s)
            ratios.append(bound / res.simulation.step_time_s)
    assert len(ratios) >= 20
    assert max(ratios) > 0.5  # a bound that says something (tiny models: fixed costs dominate their steps)


def test_bound_without_rounds_charges_the_whole_group():
    spec = ModelSpec.from_config_dict(SMALL)
    cost = CostModel(spec, dims=ParallelDims(2, 4, 1, "sp"), memory_budget_bytes=GIB)
    assert group_sizes(cost, True) == [1, 2, 4] and group_sizes(cost, False) == [4]
    lengths = BATCHES["one-long"]
    # Rounds may put a unit on one GPU (no all-to-all): the bound over every group size is lower.
    assert step_time_bound(lengths, cost, sp_rounds=False) > step_time_bound(lengths, cost) > 0
    whole = plan_step(lengths, spec, cost.dims, dataclasses.replace(SearchInputs(
        lengths, spec, default_profile(), GIB, 4, {}).options(cost.dims), sp_rounds=False), cost=cost)
    assert step_time_bound(lengths, cost, sp_rounds=False) <= whole.simulation.step_time_s


def test_a_negative_fixed_cost_gives_no_bound(monkeypatch):
    spec = ModelSpec.from_config_dict(TINY)
    cost = CostModel(spec, dims=ParallelDims(2, 1, 1), memory_budget_bytes=GIB)
    assert stage_coefficients(cost, 0, [1]) is not None
    monkeypatch.setattr(cost.compute, "unit_fwd_s", -1e-3)
    assert stage_coefficients(cost, 0, [1]) is None and step_time_bound([100, 200], cost) == 0.0
