"""The engine's timeline data: JSON round trip, merging ranks' timelines, the bubble fraction."""
from __future__ import annotations

import json

import pytest

from infinipipe_hf.runtime.engine.timeline import Timeline, TimelineEvent


def test_timeline_roundtrip_merge_and_bubble():
    a = Timeline(3, [TimelineEvent(0, 0, 0, "F0", 10.0, 11.0), TimelineEvent(0, 0, 0, "B0", 13.0, 14.0)])
    b = Timeline(3, [TimelineEvent(1, 1, 0, "F0", 11.0, 12.0, wait_s=0.5),
                     TimelineEvent(1, 1, 0, "B0", 12.0, 13.0)])
    merged = Timeline.merge([Timeline.from_dict(json.loads(a.to_json())), b])
    assert [e.action for e in merged.events] == ["F0", "F0", "B0", "B0"]
    assert merged.span_s == 4.0
    # busy: rank 0 2 s, rank 1 1.5 s, out of 2 ranks x 4 s
    assert merged.bubble_fraction() == pytest.approx(1 - 3.5 / 8)
    assert merged.relative().start_s == 0.0
    with pytest.raises(AssertionError):
        Timeline.merge([a, Timeline(4, [])])
