"""A profile JSON with fields this version does not know is refused by name (not a TypeError)."""
import pytest

from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile


def test_unknown_fields_are_named():
    d = default_profile().to_dict()
    assert HardwareProfile.from_dict(d) == default_profile()
    with pytest.raises(ValueError, match=r"profile fields \['pinned_ranks', 'shared_cores'\] are not known"):
        HardwareProfile.from_dict({**d, "shared_cores": 2.0, "pinned_ranks": True})
