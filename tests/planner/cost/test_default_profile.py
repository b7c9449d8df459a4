"""The shipped default profile carries the calibration; the layer fit alone stays loadable by name,
and a profile fitted from measurement rows takes the calibration it is given (the GPU profiler's)."""
import json

import pytest

from infinipipe_hf.cli.inputs import read_profile
from infinipipe_hf.planner.cost.profile import (
    HardwareProfile,
    default_profile,
    fit_profile,
    shipped_calibration,
    uncalibrated_profile,
)


def _rows():
    from importlib import resources

    data = json.loads(resources.files("infinipipe_hf.profiles").joinpath("h100_bf16_measurements.json").read_text())
    return data["rows"], data["reference"]


def test_default_is_the_layer_fit_divided_by_epps_efficiency():
    d, u = default_profile(), uncalibrated_profile()
    assert u.calibration.is_ideal and not d.calibration.is_ideal
    eff = d.calibration.compute_efficiency
    assert 0.7 < eff < 0.9  # EPP's own H100 steps: simulated / measured 0.785 and 0.811
    for key in ("layer_forward", "layer_backward", "head_forward", "head_backward"):
        assert getattr(d, key).token_s == pytest.approx(getattr(u, key).token_s / eff)
    assert d.meta["efficiency_sources"]["epp"]


def test_shipped_profiles_load_by_name_and_a_missing_path_says_how_to_fix_it(tmp_path):
    assert HardwareProfile.load("uncalibrated") == uncalibrated_profile()
    assert read_profile("uncalibrated") == uncalibrated_profile() and read_profile("default") == default_profile()
    with pytest.raises(ValueError, match="does not exist"):
        HardwareProfile.load(tmp_path / "nope.json")


def test_a_fitted_profile_takes_the_calibration_it_is_given():
    rows, ref = _rows()
    plain = fit_profile(rows, ref, name="mine")
    cal = fit_profile(rows, ref, name="mine", calibration=shipped_calibration())
    assert plain.calibration.is_ideal and cal.calibration == shipped_calibration() and cal.name == "mine"
    eff = shipped_calibration().compute_efficiency
    assert cal.layer_backward.fixed_s == pytest.approx(plain.layer_backward.fixed_s / eff)
    assert cal.layer_forward.attn_pair_s == pytest.approx(plain.layer_forward.attn_pair_s / eff)
