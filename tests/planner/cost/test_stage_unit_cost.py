"""The per-unit stage cost (``HardwareProfile.stage_unit_s``): charged once per action, not per layer."""
import dataclasses
import json

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.compute import UnitShape, stage_unit_costs
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile

SPEC = ModelSpec("llama", 16, 2048, 8192, 32, 8, 64, 128256, True)
SHAPE = UnitShape(8192.0 ** 2, 8192)


def _cost(profile: HardwareProfile, layers=(2, 8, 6)) -> CostModel:
    return CostModel(SPEC, profile, ParallelDims(pp_degree=len(layers)), layers_per_stage=list(layers))


def test_an_old_profile_charges_nothing_per_unit_and_keeps_its_times():
    old = default_profile()
    assert old.stage_unit_s == {} and stage_unit_costs(old) == (0.0, 0.0)
    explicit = _cost(dataclasses.replace(old, stage_unit_s={"forward": 0.0, "backward": 0.0}))
    cost = _cost(old)
    for s in range(3):  # bit-identical: adding 0.0 changes no float
        assert cost.compute.forward_time(s, SHAPE) == explicit.compute.forward_time(s, SHAPE)
        assert cost.backward_time(s, SHAPE, 1) == explicit.backward_time(s, SHAPE, 1)


def test_the_per_unit_cost_is_added_once_per_action_whatever_the_depth():
    fwd_s, bwd_s = 3e-3, 5e-3
    base = _cost(default_profile())
    cost = _cost(dataclasses.replace(default_profile(), stage_unit_s={"forward": fwd_s, "backward": bwd_s}))
    for s in range(3):  # stages of 2, 8 and 6 layers: the same seconds on each
        assert cost.compute.forward_time(s, SHAPE) - base.compute.forward_time(s, SHAPE) == pytest.approx(fwd_s)
        assert cost.backward_time(s, SHAPE, 2) - base.backward_time(s, SHAPE, 2) == pytest.approx(bwd_s)
    want = max(cost.compute.forward_time(s, SHAPE) + cost.backward_time(s, SHAPE, 0) for s in range(3))
    assert cost.compute.slowest_stage_time(SHAPE) == want


def test_the_field_round_trips_through_json_and_bad_values_are_refused(tmp_path):
    prof = dataclasses.replace(default_profile(), stage_unit_s={"forward": 1e-4, "backward": 2e-4})
    path = tmp_path / "p.json"
    prof.save(path)
    assert json.loads(path.read_text())["stage_unit_s"] == {"forward": 1e-4, "backward": 2e-4}
    assert HardwareProfile.load(path) == prof
    for bad in ({"forward": -1e-3}, {"fwd": 1e-3}):
        with pytest.raises(ValueError, match="stage_unit_s must map forward and backward"):
            _cost(dataclasses.replace(default_profile(), stage_unit_s=bad)).compute
