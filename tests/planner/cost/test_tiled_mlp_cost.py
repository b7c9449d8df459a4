"""The cost of a unit whose MLP runs in tiles (planner/cost/activations.py, working.py, levels.py):
the MLP's intermediates count for a tile of tokens, not the unit's, in the linear bound and in the
phase model; the tiles' recompute is priced as the runtime runs it (tests/runtime/recompute/
test_tiled_mlp.py counts the GEMMs)."""
from __future__ import annotations

import pytest

from infinipipe_hf.ir.levels import MLP, MLP_ACT, CheckpointMix
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.compute import UnitShape
from tests.planner.cost.test_working_memory import SPEC, WORKING, _cost


def test_mlp_bytes_are_the_mlp_levels_share():
    cost = _cost()
    a = cost.acts
    assert a.mlp_bytes_per_token == pytest.approx(cost.levels.saved_bytes_per_token[MLP])
    assert a.mlp_bytes_per_token == pytest.approx(a.act_bytes_per_token * 4 * SPEC.intermediate_size / (
        10 * SPEC.hidden_size + 4 * SPEC.intermediate_size + 2 * SPEC.kv_dim))


@pytest.mark.parametrize("backward", [False, True])
def test_linear_bound_counts_the_mlp_for_one_tile(backward):
    a = _cost().acts
    act, m, lw, h = a.act_bytes_per_token, a.mlp_bytes_per_token, a.layer_working_bytes_per_token, a.hidden_bytes_per_token
    out = (act - m) / act
    tile, t = 256, 50_000
    want = t * (lw * out + 2 * h + (2 * (act - m) if backward else 0.0)) + tile * (lw * (1 - out) + m * (1 + backward))
    assert a.working_bytes(0, t, 1, backward, mlp_tile_tokens=tile) == pytest.approx(want)
    # Past the tile the MLP adds nothing per token: the slope is the layer outside its MLP.
    slope = a.working_bytes(0, 2 * t, 1, backward, mlp_tile_tokens=tile) - a.working_bytes(0, t, 1, backward, mlp_tile_tokens=tile)
    assert slope == pytest.approx(t * (lw * out + 2 * h + (2 * (act - m) if backward else 0.0)))
    assert a.working_bytes(0, t, 1, backward, mlp_tile_tokens=tile) < a.working_bytes(0, t, 1, backward)
    # A tile longer than the unit is the unit.
    assert a.tiled_mlp_bytes(100, 10_000, backward) == pytest.approx(100 * (lw * (1 - out) + m * (1 + backward)))


def test_kept_layers_of_a_tiled_unit_keep_no_mlp_intermediate():
    a = _cost().acts
    segs = (Segment(0, 0, 1000),)
    for ckpt in (0, 1, 2):
        diff = a.unit_activation_bytes(0, segs, ckpt) - a.unit_activation_bytes(0, segs, ckpt, mlp_tiled=True)
        assert diff == pytest.approx((2 - ckpt) * 1000 * a.mlp_bytes_per_token)


def test_phase_model_by_hand():
    """Stage 0 (2 layers), every layer at ``mlp``: kept ``T (A - m)`` each; backward's last layer
    rebuilds one tile's ``m`` and its gradients are the layer's outside the MLP plus one tile's."""
    cost = _cost()
    w, c = cost.working, cost.acts
    a, m, h = c.act_bytes_per_token, c.mlp_bytes_per_token, c.hidden_bytes_per_token
    g = WORKING["backward"] * c.act_ratio
    t, tile = 3000, 128
    segs = (Segment(0, 0, t),)
    extra = t * (2 * h + 2 * SPEC.head_dim * 2)
    share = m / a
    for mix in (CheckpointMix(mlp=2), CheckpointMix(), CheckpointMix(mlp_act=2), CheckpointMix(mlp=1)):
        got = w.excess(0, segs, mix, backward=True, mlp_tile_tokens=tile)
        assert got == pytest.approx(tile * m + g * (t * (1 - share) + tile * share) + extra), mix
    for mix in (CheckpointMix(full=2), CheckpointMix(offload=1, full=1), CheckpointMix(mlp=2)):
        for backward in (False, True):
            tiled = w.excess(0, segs, mix, backward, mlp_tile_tokens=tile)
            assert tiled <= w.excess(0, segs, mix, backward) + 1e-6
            longer = w.excess(0, (Segment(0, 0, 2 * t),), mix, backward, mlp_tile_tokens=tile)
            assert longer - tiled <= t * (a - m + WORKING["forward_full"] * c.act_ratio + g + 3 * h), mix


def test_tiles_recompute_priced_per_level():
    cost = _cost()
    lv = cost.levels
    shape = UnitShape.of([Segment(0, 0, 4096)])
    mlp = lv.layer_recompute_s(MLP, shape)
    tokens = cost.compute.gpu_tokens(shape.tokens)
    down = lv.down_share * (lv._linear.token_s * tokens + lv._linear.fixed_s)
    assert down > 0 and mlp > lv.layer_recompute_s(MLP_ACT, shape) > 0
    assert lv.tiled_mlp_recompute_s(0, shape, CheckpointMix()) == pytest.approx(2 * mlp)
    assert lv.tiled_mlp_recompute_s(0, shape, CheckpointMix(mlp=2)) == 0.0
    assert lv.tiled_mlp_recompute_s(0, shape, CheckpointMix(mlp_act=1, mlp=1)) == pytest.approx(
        mlp - lv.layer_recompute_s(MLP_ACT, shape))
    assert lv.tiled_mlp_recompute_s(0, shape, CheckpointMix(full=1, offload=1)) == pytest.approx(2 * (mlp + down))
