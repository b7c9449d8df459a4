"""The masked-slice benchmark prices the band and the rectangle as the cost model counts their pairs."""
from benchmarks.cpu import sdpa_masked_band as bench
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.compute import UnitShape


def test_row_prices_the_band_of_the_cost_model():
    row = bench.measure(48, 80, repeat=1, rounds=1)
    pairs = UnitShape.of([Segment(0, 80, 128)]).pairs
    assert row["band_share"] == pairs / 128 ** 2
    assert row["band_ms"] == row["causal_total_ms"] * row["band_share"]
    assert row["masked_ms"] > 0 and row["masked_over_band"] == row["masked_ms"] / row["band_ms"]
    rectangle = UnitShape.of([Segment(0, 80, 128)], "rectangle").pairs
    assert rectangle == 2 * 48 * 128 and row["rectangle_share"] == rectangle / 128 ** 2
    assert row["masked_over_rectangle"] == row["masked_ms"] / row["rectangle_ms"]
