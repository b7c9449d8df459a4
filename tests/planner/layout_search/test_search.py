"""The layout search: which layouts it enumerates, that its pick is a brute force's, its pruning,
tie-break, process pool and errors."""
from types import SimpleNamespace

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import SHARD_MODES, ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.layout_search.host_tier import planned_alternatives
from infinipipe_hf.planner.layout_search.prune import PrunedOutcome
from infinipipe_hf.planner.layout_search.result import LayoutOutcome, NoLayoutFits
from infinipipe_hf.planner.layout_search.search import enumerate_layouts, fits_alone, pick, search_layouts
from infinipipe_hf.planner.registry import get_schedule
from infinipipe_hf.planner.schedules.base import PIPELINE
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.search.grad_reduce import reduce_modes, with_reduce
from infinipipe_hf.planner.search.limits import largest_trainable_length
from infinipipe_hf.planner.simulate.simulator import simulate

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
SPEC = ModelSpec.from_config_dict(TINY)
LENGTHS = [6000, 3000, 1200, 800, 500, 300, 200, 100]
# The planner's default checkpoint solve has no wall-clock limit, so every plan here is the same on a
# loaded machine.


def _brute_force(layouts, budget_gib):
    """``plan_step`` on every layout, no pruning: layout -> PlanResult."""
    out = {}
    for lay in layouts:
        cost = CostModel(SPEC, dims=lay, memory_budget_bytes=budget_gib * GIB)
        out[lay] = plan_step(LENGTHS, SPEC, lay, PlanOptions(), cost=cost)
    return out


def test_enumerates_every_runnable_layout_and_nothing_else():
    layouts = enumerate_layouts(SPEC, 8, 8)
    assert len(set(layouts)) == len(layouts)
    for lay in layouts:
        assert lay.pp_degree * lay.sp_degree * lay.dp_degree == 8
        assert lay.pp_degree <= SPEC.num_layers and lay.sp_degree <= SPEC.num_attention_heads
    # pp 8 exceeds the 4 layers, sp 8 the 4 heads; every (pp, sp) that is left appears.
    assert {(lay.pp_degree, lay.sp_degree) for lay in layouts} == {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2),
                                                                   (4, 2), (1, 4), (2, 4)}
    for pp, sp in {(lay.pp_degree, lay.sp_degree) for lay in layouts}:
        dp = 8 // (pp * sp)
        listed = {lay.shard.name for lay in layouts if (lay.pp_degree, lay.sp_degree) == (pp, sp)}
        for shard in SHARD_MODES:  # the layout object's checks decide, not a table of our own
            try:
                ParallelDims(pp, sp, dp, shard).check_runnable()
                ok = True
            except ValueError:
                ok = False
            assert (shard in listed) == ok, (pp, sp, shard)


def test_sp_groups_stay_inside_a_node_or_span_whole_nodes():
    wide = ModelSpec.from_config_dict({**TINY, "num_attention_heads": 32, "num_key_value_heads": 8})
    layouts = enumerate_layouts(ModelSpec.from_config_dict({**TINY, "num_attention_heads": 16,
                                                            "num_key_value_heads": 16}), 12, 6)
    assert {lay.sp_degree for lay in layouts} == {1, 2}  # 4 splits a node of 6, 12 is no power of two
    layouts = enumerate_layouts(wide, 32, 8)
    assert {lay.sp_degree for lay in layouts} == {1, 2, 4, 8, 16, 32}
    spanning = [lay for lay in layouts if lay.sp_degree > 8]
    assert spanning and all(lay.sp_crosses_nodes for lay in spanning)  # priced at the inter-node links
    assert not any(lay.sp_crosses_nodes for lay in layouts if lay.sp_degree <= 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=12, gpus_per_node=8), "world size 12 is not a whole number of nodes of 8 GPUs"),
    (dict(world_size=8, gpus_per_node=8, sp_degrees=(3,)), "no parallel layout of 8 GPUs (8 per node) can run "
                                                           "this model with sp_degree in (3,)"),
    (dict(world_size=2, gpus_per_node=8, sp_degrees=(2,), shards=("dp",)), "with sp_degree in (2,), shard in"),
    (dict(world_size=0, gpus_per_node=8), "world_size must be a positive integer, got 0"),
    (dict(world_size=8, gpus_per_node=8, shards=("zero3",)), "shard='zero3' is not known"),
])
def test_no_runnable_layout_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError) as exc:
        enumerate_layouts(SPEC, **kwargs)
    assert message in str(exc.value)


@pytest.mark.parametrize("budget_gib", [0.3, 0.1])
def test_pick_is_the_fastest_of_a_brute_force(budget_gib):
    search = search_layouts(LENGTHS, SPEC, world_size=4, gpus_per_node=4, memory_budget_bytes=budget_gib * GIB)
    brute = _brute_force([o.layout for o in search.layouts], budget_gib)
    fastest = max(r.simulation.tokens_per_s for r in brute.values() if r.feasible)
    assert search.recommended.tokens_per_s == pytest.approx(fastest, rel=1e-12)
    for o in search.layouts:  # ruling out only removes layouts plan_step cannot fit either
        if isinstance(o, PrunedOutcome):  # pruning only layouts slower than the pick
            got = brute[o.layout].simulation.tokens_per_s if brute[o.layout].feasible else 0.0
            assert got <= o.bound_tokens_per_s < fastest
            continue
        assert o.feasible == brute[o.layout].feasible, o.layout
        if o.feasible:
            assert o.tokens_per_s == pytest.approx(brute[o.layout].simulation.tokens_per_s, rel=1e-12)
    assert [o.tokens_per_s for o in search.layouts] == sorted((o.tokens_per_s for o in search.layouts), reverse=True)
    assert set(search.alternatives) == set(planned_alternatives(0.0))  # alst only with a host tier


def test_rules_out_layouts_before_planning_and_prices_hybrid_as_sp():
    search = search_layouts(LENGTHS, SPEC, world_size=4, gpus_per_node=4, memory_budget_bytes=0.1 * GIB,
                            alternatives=False)
    by = {o.layout: o for o in search.layouts}
    ruled = by[ParallelDims(1, 1, 4, "none", 4)]
    assert ruled.result is None and "does not fit even alone" in ruled.ruled_out
    hybrid, sp = by[ParallelDims(1, 2, 2, "hybrid", 4)], by[ParallelDims(1, 2, 2, "sp", 4)]
    assert hybrid.priced_as == "sp" and hybrid.tokens_per_s == sp.tokens_per_s and hybrid.result is sp.result
    d = search.to_dict()
    assert d["num_planned"] < d["num_layouts"] and d["alternatives"] == [] and d["search_time_s"] > 0


def test_states_over_budget_are_ruled_out():
    search_kw = dict(world_size=2, gpus_per_node=2, alternatives=False)
    cost = CostModel(SPEC, dims=ParallelDims(pp_degree=1, sp_degree=1, dp_degree=2))
    budget = cost.acts.static_bytes(0) * 0.9  # unsharded pp 1 cannot hold its states; pp 2 or sharding can
    search = search_layouts(LENGTHS[-3:], SPEC, memory_budget_bytes=budget, **search_kw)
    none = next(o for o in search.layouts if o.layout == ParallelDims(1, 1, 2, "none", 2))
    assert none.ruled_out.startswith("model states alone need") and not none.feasible
    assert search.recommended.layout != ParallelDims(1, 1, 2, "none", 2)


def _outcome(pp, sp, shard, tps, peak):
    sim = SimpleNamespace(tokens_per_s=tps, peak_memory_bytes=[peak])
    return LayoutOutcome(ParallelDims(pp, sp, 8 // (pp * sp), shard), SimpleNamespace(feasible=True, simulation=sim),
                         None, 0.0)


def test_tie_break():
    a = _outcome(2, 2, "sp", 100.0, 5.0)
    assert pick([_outcome(4, 1, "none", 99.0, 1.0), a]) is a  # faster wins
    b = _outcome(2, 2, "none", 100.0 * (1 + 1e-12), 4.0)
    assert pick([a, b]) is b  # equal speed: lower peak memory
    c, d = _outcome(1, 4, "sp", 100.0, 5.0), _outcome(1, 2, "sp", 100.0, 5.0)
    assert pick([a, c, d]) is d  # then fewer stages, then smaller sp
    e, f = _outcome(2, 2, "hybrid", 100.0, 5.0), _outcome(2, 2, "dp", 100.0, 5.0)
    assert pick([e, f, a]) is a  # then the shard mode's order
    assert pick([]) is None


def test_process_pool_gives_the_same_search():
    kw = dict(world_size=4, gpus_per_node=4, memory_budget_bytes=0.1 * GIB, alternatives=False)
    one, two = (search_layouts(LENGTHS, SPEC, prune=False, **kw),
                search_layouts(LENGTHS, SPEC, workers=2, prune=False, **kw))
    assert [(o.layout, o.tokens_per_s, o.error) for o in one.layouts] == \
        [(o.layout, o.tokens_per_s, o.error) for o in two.layouts]
    pruned = search_layouts(LENGTHS, SPEC, workers=2, **kw)  # which are pruned may vary, the pick cannot
    assert (pruned.recommended.layout, pruned.recommended.tokens_per_s) == \
        (one.recommended.layout, one.recommended.tokens_per_s)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        search_layouts(LENGTHS, SPEC, world_size=4, gpus_per_node=4, workers=0)


def test_no_layout_fits_names_the_largest_trainable_sequence_per_layout():
    with pytest.raises(NoLayoutFits) as exc:
        search_layouts(LENGTHS, SPEC, world_size=4, gpus_per_node=4, memory_budget_bytes=0.046 * GIB)
    search, message = exc.value.search, str(exc.value)
    assert search.recommended is None and len(search.layouts) == 14
    assert "no layout of 4 GPUs fits 0.046 GiB per GPU" in message
    for o in search.layouts:  # judged with the leaner gradient reduction where the layout can run it
        cost = CostModel(SPEC, dims=o.layout, memory_budget_bytes=0.046 * GIB)
        cost = with_reduce(cost, reduce_modes("auto", cost)[-1])
        assert o.largest_trainable == max(largest_trainable_length(cost, k) for k in (1, 64))
        assert f"{o.layout.label} shard {o.layout.shard}: {o.largest_trainable}" in message
    # pp 4, and pp 1 x sp 4 sharded over SP reducing gradients per unit, train the longest sequence
    # alone but not the whole batch: the message says so.
    assert "fits alone on 2 of them but the whole batch" in message
    assert search.to_dict()["recommended"] is None


def test_a_sequence_that_fits_only_unsliced_is_not_ruled_out():
    """Many layers with full-width K/V: at pp 1 the K/V store of 23 slices outweighs the one
    layer recomputed whole, so 1 slice is the leanest plan; the pruning must find it."""
    deep = ModelSpec.from_config_dict({**TINY, "intermediate_size": 256, "num_hidden_layers": 32,
                                       "num_key_value_heads": 4, "vocab_size": 256})
    lean = get_schedule("epp", PIPELINE).leanest_plan
    wide = CostModel(deep, dims=ParallelDims(pp_degree=1), memory_budget_bytes=100 * GIB)
    one, many = (max(simulate(lean(wide, 6000, k), wide).peak_memory_bytes) for k in (1, 64))
    assert one < many  # the case this test is about
    budget = (one + many) / 2
    cost = CostModel(deep, dims=ParallelDims(pp_degree=1), memory_budget_bytes=budget)
    with pytest.raises(ValueError, match="does not fit with every layer checkpointed"):
        lean(cost, 6000, 64)  # the most slices do not fit...
    assert fits_alone(cost, 6000)  # ...one does
    search = search_layouts([6000], deep, world_size=1, gpus_per_node=1, memory_budget_bytes=budget,
                            alternatives=False)
    assert search.recommended.layout == ParallelDims(1, 1, 1, "none", 1)
    assert plan_step([6000], deep, ParallelDims(pp_degree=1), cost=cost).feasible  # what the pruning must not lose
