"""Plan keys of the host tier: ``offload`` in ``checkpoint_levels`` and ``offload_kv``, through JSON."""
from __future__ import annotations

import json

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.plan import Plan
from tests.planner.hand_plans import epp_plan


def test_offload_level_and_offload_kv_round_trip_and_stay_absent_when_unused():
    plan = epp_plan([4096, 2048], 2, 2048, 2048)
    plan.checkpoint_layers = {s: {u.id: 1 for u in plan.units} for s in range(2)}
    assert "offload_kv" not in plan.to_dict() and "checkpoint_levels" not in plan.to_dict()
    plan.checkpoint_levels = {0: {0: {"offload": 2, "mlp": 1}}, 1: {2: {"offload": 1}}}
    plan.offload_kv = [1, 0]
    d = json.loads(plan.to_json())
    assert d["offload_kv"] == [0, 1]
    assert d["checkpoint_levels"] == {"0": {"0": {"mlp": 1, "offload": 2}}, "1": {"2": {"offload": 1}}}
    back = Plan.from_json(plan.to_json())
    assert back.offload_kv == [0, 1]
    assert back.checkpoint_levels == plan.checkpoint_levels
    assert back.checkpoint_mix(0, 0) == CheckpointMix(full=1, mlp=1, offload=2)
    assert back.to_dict() == d
    assert "(o2+c1+m1)" in str(back)


def test_uses_host_tier_sees_each_host_level_and_offload_kv():
    plan = epp_plan([4096, 2048], 2, 2048, 2048)
    plan.checkpoint_levels = {0: {0: {"mlp": 2, "keep_attn": 1}}}
    assert not plan.uses_host_tier  # device levels only
    for level in ("offload", "offload_attn"):
        plan.checkpoint_levels = {0: {0: {"mlp": 1}}, 1: {1: {level: 1}}}
        assert plan.uses_host_tier, level
    plan.checkpoint_levels = {}
    plan.offload_kv = [1]
    assert plan.uses_host_tier
