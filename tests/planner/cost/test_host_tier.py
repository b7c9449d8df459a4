"""The host tier's prices by hand on a small spec: the offload level's device and host bytes, its
exposed copy seconds, the offloaded KV store's device share and copies."""
from __future__ import annotations

import dataclasses
import random

import pytest

from infinipipe_hf.ir.levels import FULL, OFFLOAD, CheckpointMix
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from tests.planner.cost.test_working_memory import _cost
from tests.planner.hand_plans import LLAMA8B, TINY

GIB = 2**30


def tiny_cost(host=64 * GIB, bandwidth=None, pp=2):
    p = default_profile()
    if bandwidth is not None:
        p = dataclasses.replace(p, host_bandwidth_bytes_per_s=bandwidth)
    return CostModel(TINY, p, ParallelDims(pp_degree=pp), layers_per_stage=[3, 3][:pp] if pp == 2 else [6],
                     host_budget_bytes=host)


def test_offload_layer_saves_full_plus_its_input_and_holds_the_input_on_host():
    cost = tiny_cost()
    segs = (Segment(0, 0, 2048),)
    hidden = 2048 * TINY.hidden_size * cost.profile.bytes_per_element  # the input, by hand
    full = cost.levels.layer_saved_bytes(FULL, 0, segs)
    assert cost.levels.layer_saved_bytes(OFFLOAD, 0, segs) == pytest.approx(full + hidden)
    assert cost.host.layer_offload_bytes(0, segs) == pytest.approx(hidden)
    # A unit's activations: two offloaded layers keep 2 inputs fewer than two whole layers.
    two_full = cost.levels.unit_activation_bytes(0, segs, CheckpointMix(full=2))
    two_off = cost.levels.unit_activation_bytes(0, segs, CheckpointMix(offload=2))
    assert two_full - two_off == pytest.approx(2 * hidden)


def test_offload_copies_hide_behind_compute_at_pcie_speed_and_are_priced_when_they_cannot():
    shape = UnitShape.of((Segment(0, 0, 4096),))
    fast = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=4), host_budget_bytes=GIB)
    copy = 4096 * LLAMA8B.hidden_size * 2 / fast.profile.host_bandwidth_bytes_per_s
    assert copy < fast.compute.layer_fwd(shape.pairs, shape.tokens)  # an 8B layer outlasts its input's copy
    assert fast.host.layer_exposed_s(shape) == 0.0
    assert fast.levels.layer_recompute_s(OFFLOAD, shape) == fast.levels.layer_recompute_s(FULL, shape)
    slow = tiny_cost(bandwidth=1e6)  # 1 MB/s: every copy exposed
    copy = 4096 * TINY.hidden_size * slow.profile.bytes_per_element / 1e6
    fwd = slow.compute.layer_fwd(shape.pairs, shape.tokens)
    bwd = slow.compute.layer_bwd(shape.pairs, shape.tokens) + fwd
    exposed = (copy - fwd) + (copy - bwd)
    assert slow.host.layer_exposed_s(shape) == pytest.approx(exposed)
    assert slow.levels.layer_recompute_s(OFFLOAD, shape) == pytest.approx(
        slow.levels.layer_recompute_s(FULL, shape) + exposed)
    # The mix prices it per offloaded layer, in the backward's recompute.
    mix = CheckpointMix(offload=2)
    assert slow.levels.recompute_time(0, shape, mix) == pytest.approx(
        2 * slow.levels.layer_recompute_s(OFFLOAD, shape))


def test_offloaded_kv_store_keeps_two_layers_on_device_and_copies_context_per_layer():
    cost = tiny_cost(pp=1)
    assert cost.host.kv_device_share(0) == pytest.approx(1 / 6)
    per = cost.acts.kv_bytes_per_token_per_layer  # K and V of one token, one layer
    segs = (Segment(0, 1024, 2048),)
    assert cost.host.kv_copy_bytes(segs, [True], backward=False) == pytest.approx((1024 + 1024) * per)
    assert cost.host.kv_copy_bytes(segs, [False], backward=False) == pytest.approx(1024 * per)
    assert cost.host.kv_copy_bytes(segs, [True], backward=True) == pytest.approx(3 * 1024 * per)
    slow = dataclasses.replace(cost.profile, host_bandwidth_bytes_per_s=1e6)
    slow_cost = CostModel(TINY, slow, ParallelDims(), host_budget_bytes=GIB)
    shape = UnitShape.of(segs)
    copy = 2048 * per / 1e6
    fwd = slow_cost.compute.layer_fwd(shape.pairs, shape.tokens)
    assert slow_cost.host.kv_exposed_s(0, segs, [True], backward=False) == pytest.approx(6 * (copy - fwd))


def test_host_budget_must_be_non_negative_and_defaults_to_no_tier():
    assert CostModel(TINY).host_budget_bytes == 0.0
    assert not CostModel(TINY).host.enabled
    with pytest.raises(ValueError, match="host_budget_bytes"):
        CostModel(TINY, host_budget_bytes=-1.0)


@pytest.mark.parametrize("seed", range(3))
def test_working_bound_covers_offloaded_layers(seed):
    """With a host tier the phase model's bound (the solver's linear base) stays above the exact
    phases of every mix with offloaded layers; without one the bound is unchanged."""
    rng = random.Random(seed)
    cost, plain = _cost(host_budget_bytes=GIB), _cost()
    for _ in range(30):
        stage = rng.randint(0, 1)
        start = rng.choice([0, 0, 128, 900])
        segs = (Segment(0, start, start + rng.randint(1, 600)),)
        off = rng.randint(0, 2)
        mix = CheckpointMix.of(rng.randint(0, 2 - off), {OFFLOAD: off})
        tokens = sum(s.end - s.start for s in segs)
        ctx = cost.acts.context_bytes_per_layer(segs)
        for backward in (False, True):
            assert cost.working.excess(stage, segs, mix, backward) <= cost.working.bound(stage, tokens, ctx, backward) + 1e-6
            no_off = CheckpointMix.of(mix.full + off, {})
            assert plain.working.bound(stage, tokens, ctx, backward) <= cost.working.bound(stage, tokens, ctx, backward)
            assert plain.working.excess(stage, segs, no_off, backward) <= plain.working.bound(stage, tokens, ctx, backward) + 1e-6


def test_remembered_recompute_seconds_are_each_shapes_and_levels_own():
    """``layer_recompute_s`` remembers per (level, shape): every answer equals a fresh computation."""
    cost = tiny_cost(bandwidth=1e9)
    shapes = [UnitShape(pairs=float(n * n), tokens=n) for n in (64, 512, 64)]
    for level in (FULL, OFFLOAD, "mlp", "keep_attn"):
        for shape in shapes:
            assert cost.levels.layer_recompute_s(level, shape) == cost.levels._layer_recompute_s(level, shape)
    assert cost.levels.layer_recompute_s(OFFLOAD, shapes[0]) != cost.levels.layer_recompute_s(OFFLOAD, shapes[1])
