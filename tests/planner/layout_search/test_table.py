"""The layout search's table: a ratio near 1 keeps the digits that tell a lead from a lag."""
from infinipipe_hf.planner.layout_search.table import _ratio


def test_ratios_within_half_a_percent_of_one_show_three_decimals():
    assert [_ratio(x) for x in (0.9984, 1.0, 1.0049, 1.0064, 1.16, 0.95)] == \
        ["0.998x", "1.000x", "1.005x", "1.01x", "1.16x", "0.95x"]
