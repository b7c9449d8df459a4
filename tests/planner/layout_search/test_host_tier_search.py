"""The layout search with a host tier: which state-offload modes it plans, the largest
one-sequence length (searched, then confirmed by ``plan_step``), and advice without a host tier."""
import dataclasses

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.planner.layout_search.host_tier import offload_modes, planned_alternatives, with_offload_modes
from infinipipe_hf.planner.layout_search.longest import (
    SMALLEST,
    LengthCache,
    candidates_fit,
    largest_length,
)
from infinipipe_hf.planner.layout_search.result import NoLayoutFits
from infinipipe_hf.planner.layout_search.search import SearchInputs, pricing_key, search_layouts
from infinipipe_hf.planner.registry import ALTERNATIVES
from infinipipe_hf.planner.search.api import PlanOptions, plan_step

TINY = ModelSpec.from_config_dict({
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1 << 22})


@pytest.mark.parametrize("limit", [SMALLEST, 1000, 4096, 77_777, 1 << 20])
def test_largest_length_is_within_a_sixteenth_below_the_limit(limit):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    for seed in (SMALLEST, limit, 50 * limit):
        got = largest_length(fits, seed)
        assert limit * (1 - 1 / 16) <= got <= limit
    assert largest_length(lambda n: False, 4096) == 0


def test_length_cache_plans_each_length_once():
    seen = []
    cache = LengthCache(lambda lay, host, n: seen.append(n) or n <= 5000, pricing_key)
    lay = ParallelDims()
    assert cache.largest(lay, 0.0, 4096) == cache.largest(lay, 0.0, 4096)
    assert cache.plans == len(seen) == len(set(seen))


def test_offload_modes_need_a_host_tier():
    assert offload_modes(0.0) == ("none",) and offload_modes(GIB) == ("none", "optimizer", "states")
    with pytest.raises(ValueError, match="the host budget is 0"):
        offload_modes(0.0, ("optimizer",))
    with pytest.raises(ValueError, match="state_offload='disk' is not known"):
        offload_modes(GIB, ("disk",))
    assert "alst" not in planned_alternatives(0.0) and planned_alternatives(GIB) == ALTERNATIVES


def test_heavier_modes_only_where_the_lighter_leaves_states_large():
    share = {"none": 0.6, "optimizer": 0.3, "states": 0.05}  # of the budget, per mode
    sharded, alone, unsharded_sp = ParallelDims(1, 2, 1, "sp"), ParallelDims(2, 1, 1), ParallelDims(1, 2, 1)
    out = with_offload_modes([sharded, alone, unsharded_sp], ("none", "optimizer", "states"),
                             lambda lay: share[lay.state_offload.name], 1.0)
    # Weights on host run over the shard group, or over each GPU alone (sp = dp = 1), not otherwise.
    assert [(d.sp_degree, d.shard.name, d.state_offload.name) for d in out] == [
        (2, "sp", "none"), (2, "sp", "optimizer"), (2, "sp", "states"), (1, "none", "none"), (1, "none", "optimizer"),
        (1, "none", "states"), (2, "none", "none"), (2, "none", "optimizer")]
    share["optimizer"] = 0.2  # under a quarter: 'states' would only cost time
    out = with_offload_modes([sharded], ("none", "optimizer", "states"), lambda lay: share[lay.state_offload.name], 1.0)
    assert [d.state_offload.name for d in out] == ["none", "optimizer"]
    share["none"] = 0.1
    assert [d.state_offload.name for d in with_offload_modes(
        [sharded], ("none", "optimizer", "states"), lambda lay: share[lay.state_offload.name], 1.0)] == ["none"]


def test_the_largest_length_is_what_plan_step_trains():
    search = search_layouts([30000], TINY, world_size=2, gpus_per_node=2, memory_budget_bytes=0.12 * GIB,
                            host_budget_bytes=GIB, alternatives=False)
    fed = [o for o in search.layouts if o.largest_length is not None]
    assert fed and all(o.layout.dp_degree == 1 for o in fed)
    o = max(fed, key=lambda o: o.largest_length)
    assert o.largest_length > o.largest_length_without_offload > 0

    def plans(n, host, lay=o.layout):
        cost = CostModel(TINY, None, lay, memory_budget_bytes=0.12 * GIB, host_budget_bytes=host)
        return plan_step([n], TINY, lay, PlanOptions(), cost=cost).feasible

    # plan_step trains the reported lengths and not an eighth more (the search is within 1/16).
    assert plans(o.largest_length, GIB) and not plans(int(o.largest_length * 1.125), GIB)
    without, base = o.largest_length_without_offload, dataclasses.replace(o.layout, state_offload="none")
    assert plans(without, 0.0, base) and not plans(int(without * 1.125), 0.0, base)


def test_without_a_host_tier_the_no_fit_message_names_host_memory():
    with pytest.raises(NoLayoutFits, match="or give the plan host memory") as info:
        search_layouts([400_000], TINY, world_size=2, gpus_per_node=2, memory_budget_bytes=0.12 * GIB,
                       alternatives=False, longest=False)
    assert info.value.search.host_budget_bytes == 0.0


def test_one_sequence_feasibility_tries_each_gradient_reduce_mode():
    """Llama-3.1-8B at pp 1 x sp 8 shard sp with a host tier: 3.4M tokens fit only with gradients
    reduced per unit, which ``plan_step`` plans; the length search's feasibility must agree."""
    spec = dataclasses.replace(ModelSpec.from_json_file(config_path("llama3.1-8b")), max_position_embeddings=1 << 25)
    lay = ParallelDims(1, 8, 1, "sp", gpus_per_node=8)
    cost = CostModel(spec, None, lay, memory_budget_bytes=71.6 * GIB, host_budget_bytes=256 * GIB)
    n, options = 3_440_640, PlanOptions()
    assert not candidates_fit([n], cost, PlanOptions(grad_reduce="step"))  # reduced at the step's end: no plan
    assert plan_step([n], spec, lay, options, cost=cost).feasible
    assert candidates_fit([n], cost, options)


@pytest.mark.parametrize("host,length", [(GIB, 30000), (0.0, 4096)])
def test_a_planned_one_sequence_batch_bounds_its_largest_length(monkeypatch, host, length):
    """Feasibility is not quite monotone in the length: whatever the length search reads, a layout
    that planned the one-sequence batch reports at least that length (with the host tier, or
    without one when the search has none)."""
    from infinipipe_hf.planner.layout_search import longest

    search = search_layouts([length], TINY, world_size=2, gpus_per_node=2, memory_budget_bytes=0.12 * GIB,
                            host_budget_bytes=host, alternatives=False)
    planned = [o for o in search.layouts if o.feasible and not o.layout.state_offload.offloaded]
    assert planned
    monkeypatch.setattr(longest, "searched", lambda *a, **k: 0)  # a length search that misses everything
    inputs = SearchInputs([length], TINY, default_profile(), 0.12 * GIB, 2, {}, host, True)
    for o in planned:
        longest.add_largest_lengths(inputs, o, pricing_key)
        assert o.largest_length == length
        assert o.largest_length_without_offload == (length if host == 0.0 else 0)
