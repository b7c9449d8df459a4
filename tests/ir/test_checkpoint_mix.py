"""``CheckpointMix.of``: one shared instance per mix, built and checked as the constructor does."""
import pytest

from infinipipe_hf.ir.levels import PLAN_LEVELS, CheckpointMix


def test_of_builds_the_mix_the_constructor_does_whatever_the_key_order():
    a = CheckpointMix.of(3, {"mlp": 2, "offload": 1})
    b = CheckpointMix.of(3.0, {"offload": 1, "mlp": 2})
    assert a == b == CheckpointMix(3, **{lv: {"mlp": 2, "offload": 1}.get(lv, 0) for lv in PLAN_LEVELS})
    assert CheckpointMix.of(0) == CheckpointMix.of(0, {}) == CheckpointMix()
    assert CheckpointMix.of(2, {"mlp": 1}) is CheckpointMix.of(2, {"mlp": 1})  # shared, and frozen


@pytest.mark.parametrize("full, finer", [(1, {"whole": 2}), (-1, None), (0, {"mlp": -2}), (0, {"full": 1})])
def test_of_rejects_a_bad_mix_every_time_it_is_asked(full, finer):
    for _ in range(2):  # a remembered mix must not let a bad one through the second time
        with pytest.raises(ValueError):
            CheckpointMix.of(full, finer)
