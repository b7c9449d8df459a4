"""Pruning the layout search by proven bounds (a layout's compute before planning, its candidates'
units without recompute before the finishing solve): the same pick as planning every layout, on
several batches and layouts of 4 and 8 GPUs, and the pruned layouts reported in the JSON and the table."""
import json

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.layout_search.prune import PrunedOutcome
from infinipipe_hf.planner.layout_search.search import search_layouts
from infinipipe_hf.planner.layout_search.table import format_search

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
DEEP = {**TINY, "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4}
BATCHES = {
    "long-tail": [6000, 3000, 1200, 800, 500, 300, 200, 100],
    "one-long": [12000, 700, 600, 500, 400, 300, 200, 100, 90, 80],
    "short": [512, 480, 400, 350, 300, 256, 200, 128, 100, 64, 50, 32],
    "even": [2048] * 8,
}
CASES = [(TINY, 4, 0.3, tuple(BATCHES)), (TINY, 4, 0.1, tuple(BATCHES)), (DEEP, 8, 0.3, ("long-tail", "short"))]


def _key(search):
    rec = search.recommended
    return None if rec is None else (rec.layout, rec.tokens_per_s)


@pytest.mark.parametrize("config, world, budget_gib, batches", CASES, ids=["tiny-4-0.3", "tiny-4-0.1", "deep-8-0.3"])
def test_pruned_search_picks_what_the_exhaustive_one_picks(config, world, budget_gib, batches):
    spec = ModelSpec.from_config_dict(config)
    kw = dict(world_size=world, gpus_per_node=world, memory_budget_bytes=budget_gib * GIB, alternatives=False)
    pruned_total, bases = 0, set()
    for name in batches:
        lengths = BATCHES[name]
        every = search_layouts(lengths, spec, prune=False, **kw)
        pruned = search_layouts(lengths, spec, **kw)
        assert _key(pruned) == _key(every), name
        exhaustive = {o.layout: o for o in every.layouts}
        assert not any(isinstance(o, PrunedOutcome) for o in every.layouts)
        for o in pruned.layouts:
            if isinstance(o, PrunedOutcome):  # its bound holds and is below the pick
                assert exhaustive[o.layout].tokens_per_s <= o.bound_tokens_per_s < pruned.recommended.tokens_per_s
                pruned_total += 1
                bases.add(o.basis)
            else:
                assert o.tokens_per_s == exhaustive[o.layout].tokens_per_s, (name, o.layout)
    assert pruned_total > 0 and "candidates" in bases  # the bounds prune something on these batches


def test_pruned_layouts_are_additive_keys_of_the_json_and_named_in_the_table():
    spec = ModelSpec.from_config_dict(DEEP)
    search = search_layouts(BATCHES["long-tail"], spec, world_size=8, gpus_per_node=8, memory_budget_bytes=0.3 * GIB,
                            alternatives=False)
    d = json.loads(json.dumps(search.to_dict()))
    assert d["num_pruned"] == len(d["pruned_layouts"]) > 0
    assert {"recommended", "layouts", "num_layouts", "num_planned", "search_time_s"} <= set(d)
    entry = d["pruned_layouts"][0]
    assert {"pp_degree", "sp_degree", "dp_degree", "shard", "bound_tokens_per_s", "bound_step_time_s", "reason"} <= set(entry)
    assert entry["bound_tokens_per_s"] < d["recommended"]["tokens_per_s"]
    rows = [lay for lay in d["layouts"] if "pruned" in lay]
    assert len(rows) >= d["num_pruned"] and all(not r["feasible"] and r["tokens_per_s"] == 0.0 for r in rows)
    table = format_search(search)
    assert "not planned in full: at most" in table
    # A pruned layout's row shows its bounds, not "does not fit"; it ranks under every planned layout
    # and above every layout that does not fit, highest bound first.
    pruned = [o for o in search.layouts if isinstance(o, PrunedOutcome)]
    line = next(ln for ln in table.splitlines() if f"<={pruned[0].bound_tokens_per_s:,.0f}" in ln)
    assert line.split()[10:12] == ["-", f"<={pruned[0].bound_tokens_per_s:,.0f}"] and " NO " not in line
    kinds = [0 if o.feasible else 1 if isinstance(o, PrunedOutcome) else 2 for o in search.layouts]
    assert kinds == sorted(kinds) and 2 in kinds
    bounds = [o.bound_tokens_per_s for o in pruned]
    assert bounds == sorted(bounds, reverse=True)
