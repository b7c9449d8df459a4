"""benchmarks/lib/stage_depth.py: stages of two depths separate one layer's time from the stage's
per-unit cost exactly on synthetic rows, and a profile carrying both predicts either depth."""
import dataclasses

import pytest

from benchmarks.lib.runtime_fit import fit_layer, reference_of, row_segments
from benchmarks.lib.stage_depth import (
    check_depths,
    depth_errors,
    layer_rows,
    per_kind_split,
    split_depths,
    stage_unit_fit,
    unit_kind,
)
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.profile import TimeCoefficients, default_profile

SHAPES = [[[0, 64]], [[0, 256]], [[128, 256]], [[0, 32]] * 8, [[64, 128], [0, 16], [0, 16]], [[0, 512]]]
LAYER_F, LAYER_B = TimeCoefficients(2e-9, 3e-6, 1e-4), TimeCoefficients(4e-9, 6e-6, 2e-4)
UNIT_F, UNIT_B = 7e-4, 3e-4


def _rows(depths=(1, 3), backend="auto"):
    rows = []
    for segs in SHAPES:
        shape = UnitShape.of(row_segments({"segments": segs}))
        for d in depths:
            rows.append({"kind": "unit_stage", "segments": segs, "depth": d, "backend": backend,
                         "tokens": shape.tokens, "fwd_s": UNIT_F + d * LAYER_F(shape.pairs, shape.tokens),
                         "bwd_s": UNIT_B + d * LAYER_B(shape.pairs, shape.tokens)})
    return rows


def test_the_depth_difference_recovers_the_layer_and_the_intercept_the_unit_cost():
    split = split_depths(_rows())
    assert len(split) == len(SHAPES) and {s["kind"] for s in split} == {"whole", "slice", "pack", "hybrid"}
    for s in split:
        assert s["unit_fwd_s"] == pytest.approx(UNIT_F) and s["unit_bwd_s"] == pytest.approx(UNIT_B)
    assert stage_unit_fit(split) == pytest.approx({"forward": UNIT_F, "backward": UNIT_B})
    for key, want in (("fwd_s", LAYER_F), ("bwd_s", LAYER_B)):
        got = fit_layer(layer_rows(split), key)
        assert (got.attn_pair_s, got.token_s, got.fixed_s) == pytest.approx(
            (want.attn_pair_s, want.token_s, want.fixed_s), rel=1e-6)
    kinds = per_kind_split(split)["auto"]
    assert kinds["pack"]["shapes"] == 1 and kinds["whole"]["unit_fwd_s"] == pytest.approx(UNIT_F)
    assert 0 < kinds["whole"]["unit_share_of_one_layer_fwd"] < 1


def test_a_profile_with_both_terms_predicts_every_depth_and_one_without_misses_deep_stages():
    spec = ModelSpec("llama", 5, 64, 160, 4, 2, 16, 211, True)
    base = dataclasses.replace(default_profile(), reference=reference_of(spec), layer_forward=LAYER_F,
                               layer_backward=LAYER_B)
    rows = _rows((1, 3))
    exact = depth_errors(dataclasses.replace(base, stage_unit_s={"forward": UNIT_F, "backward": UNIT_B}), spec, rows)
    assert len(exact) == len(rows)
    assert all(e[f"{k}_ratio"] == pytest.approx(1.0) for e in exact for k in ("fwd", "bwd"))
    # Without the per-unit term the model under-prices every row by exactly that term.
    folded = depth_errors(base, spec, rows)
    assert all(e["fwd_ratio"] > 1.0 for e in folded)


def test_depths_and_kinds():
    assert check_depths([3, 1]) == (1, 3)
    for bad in ([1], [2, 2], [0, 3], [1, 2, 3]):
        with pytest.raises(ValueError, match="two distinct layer counts"):
            check_depths(bad)
    assert [unit_kind(s) for s in ([[0, 8]], [[8, 16]], [[0, 4], [0, 4]], [[8, 16], [0, 4]])] == \
        ["whole", "slice", "pack", "hybrid"]
    with pytest.raises(ValueError, match="at least one shape"):
        stage_unit_fit([])
