"""``benchmarks/planner/flexsp_space.py``: EPP at pp 1 x sp = world against FlexSP on the same budget."""
from benchmarks.planner import flexsp_space


def test_batches_are_short_documents_of_unused_seeds():
    got = flexsp_space.batches()
    assert [len(v) for v in got.values()] == [512, 256]
    assert max(got["short-only 512 x 2K"]) <= 2048 and max(got["short-only 256 x 4K"]) <= 4096


def test_a_row_prices_both_on_one_budget_and_records_the_ratio():
    lengths = flexsp_space.batches()["short-only 256 x 4K"][:64]
    got = flexsp_space.row("llama2-7b", 4, 80.0, "short", lengths)
    assert got["epp_feasible"] and got["flexsp_feasible"]
    assert got["epp_over_flexsp"] == got["flexsp_step_s"] / got["epp_step_s"] > 0.99
    assert got["tokens"] == sum(lengths) and got["epp_rounds"] >= 1 and got["flexsp_rounds"] >= 1


def test_a_search_row_records_the_pick_and_its_closest_alternative():
    lengths = flexsp_space.search_batches()["short-only 256 x 2K"][:32]
    got = flexsp_space.search_row("llama2-7b", 4, 80.0, "short", lengths)
    assert got["pick"].startswith("pp ") and got["tokens_per_s"] > 0
    assert got["min_over_alternatives"] == min(got["over_alternatives"].values())
    assert got["over_alternatives"][got["min_alternative"]] == got["min_over_alternatives"]
