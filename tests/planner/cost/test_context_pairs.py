"""How a profile's attention kernel counts a slice's K/V context (``HardwareProfile.context_pairs``):
the causal band (flash, varlen) or SDPA's whole masked rectangle, priced through every path."""
from dataclasses import replace

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile

SPEC = ModelSpec("llama", 4, 256, 688, 8, 4, 32, 2048, False)


@pytest.mark.parametrize("context,length", [(1024, 1024), (2048, 1024), (1664, 384)])
def test_rectangle_counts_every_query_against_every_key_of_context_and_slice(context, length):
    seg = [Segment(0, context, context + length)]
    band, rect = UnitShape.of(seg), UnitShape.of(seg, "rectangle")
    assert band.pairs == length * length + 2 * context * length  # twice the causal band
    assert rect.pairs == 2 * length * (context + length)  # twice the rectangle
    assert rect.tokens == band.tokens == length


def test_rectangle_leaves_whole_sequences_and_packs_on_the_causal_kernel():
    segs = [Segment(0, 0, 700), Segment(1, 0, 300)]  # is_causal calls: no mask, masked blocks skipped
    assert UnitShape.of(segs, "rectangle") == UnitShape.of(segs)


def test_cost_model_prices_a_slice_with_context_by_its_profile_count():
    band = CostModel(SPEC, default_profile())
    rect = CostModel(SPEC, replace(default_profile(), context_pairs="rectangle"))
    later, first = [Segment(0, 1024, 2048)], [Segment(0, 0, 1024)]
    assert rect.shape_of(later).pairs == band.shape_of(later).pairs + 1024 ** 2  # 4/3 of the band
    assert rect.compute.forward_time(0, rect.shape_of(later)) > band.compute.forward_time(0, band.shape_of(later))
    assert rect.compute.forward_time(0, rect.shape_of(first)) == band.compute.forward_time(0, band.shape_of(first))


def test_unknown_count_is_refused_and_the_field_round_trips(tmp_path):
    with pytest.raises(ValueError, match="context_pairs must be one of"):
        replace(default_profile(), context_pairs="square")
    path = tmp_path / "p.json"
    replace(default_profile(), context_pairs="rectangle").save(path)
    assert HardwareProfile.load(path).context_pairs == "rectangle"
    assert default_profile().context_pairs == "band"  # the shipped H100 profile: flash / varlen
