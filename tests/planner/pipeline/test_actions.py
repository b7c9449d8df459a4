"""Pipeline schedules (planner/pipeline/actions.py and each schedule's warm-up): warm-up counts,
backward order of slices, and properties of every built pipeline."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinipipe_hf.ir.actions import B, F, format_actions, parse_actions
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.actions import (
    backward_order,
    build_pipeline_actions,
    concat_pipelines,
    epp_warmup,
    gpipe_warmup,
    one_f_one_b_warmup,
)
from infinipipe_hf.planner.simulate.grid import slot_replay


def test_warmups():
    assert one_f_one_b_warmup(ParallelDims(4)) == [3, 2, 1, 0]
    assert epp_warmup(ParallelDims(4), 3) == [5, 4, 3, 2]
    assert gpipe_warmup(ParallelDims(3), 7) == [7, 7, 7]


def test_one_f_one_b_lists_and_string_round_trip():
    acts = build_pipeline_actions(range(5), range(5), one_f_one_b_warmup(ParallelDims(3)))
    assert format_actions(acts[0]) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"
    assert format_actions(acts[2]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"
    for stage in acts:
        assert parse_actions(format_actions(stage)) == stage
        # warm-up count = forwards before the first backward
    assert [next(i for i, a in enumerate(s) if not a.is_forward) for s in acts] == [3, 2, 1]


def test_backward_order_reverses_chains_fifo_elsewhere():
    lengths = [30, 5, 6, 20]
    units = [Unit(0, (Segment(0, 0, 10),)), Unit(1, (Segment(0, 10, 20),)),
             Unit(2, (Segment(0, 20, 30), Segment(1, 0, 5))), Unit(3, (Segment(2, 0, 6),)),
             Unit(4, (Segment(3, 0, 12),)), Unit(5, (Segment(3, 12, 20),))]
    assert backward_order(units, lengths) == [2, 1, 0, 3, 5, 4]


def test_backward_order_rejects_crossing_units():
    units = [Unit(0, (Segment(0, 0, 5), Segment(1, 5, 10))), Unit(1, (Segment(1, 0, 5), Segment(0, 5, 10)))]
    with pytest.raises(ValueError, match="crossing"):
        backward_order(units, [10, 10])


def test_bad_order_delays_backward_instead_of_emitting_invalid_list():
    # 1F1B warm-up with a 3-slice chain first: the last slice must be forwarded before any backward.
    acts = build_pipeline_actions([0, 1, 2, 3], [2, 1, 0, 3], one_f_one_b_warmup(ParallelDims(2)))
    assert format_actions(acts[1]) == "F0 F1 F2 B2 B1 B0 F3 B3"
    assert format_actions(acts[0]) == "F0 F1 F2 B2 B1 F3 B0 B3"


def test_rejects_growing_warmup_and_mismatched_orders():
    with pytest.raises(ValueError, match="deadlock"):
        build_pipeline_actions([0, 1, 2], [0, 1, 2], [0, 2])
    with pytest.raises(ValueError, match="same unit ids"):
        build_pipeline_actions([0, 1], [0, 2], [1, 0])


def test_concat_pipelines():
    a = build_pipeline_actions([0], [0], [1, 0])
    b = build_pipeline_actions([1], [1], [1, 0])
    assert [format_actions(s) for s in a] == ["F0 B0"] * 2
    assert [format_actions(s) for s in concat_pipelines([a, b])] == ["F0 B0 F1 B1"] * 2
    with pytest.raises(ValueError):
        concat_pipelines([a, [[F(1), B(1)]]])


@st.composite
def unit_lists(draw):
    """EPP-like units: long sequences cut into 1..4 slices (tail maybe with a short one), then packed."""
    lengths, units = [], []
    for _ in range(draw(st.integers(1, 4))):
        k = draw(st.integers(1, 4))
        seq = len(lengths)
        lengths.append(10 * k)
        for i in range(k):
            segs = [Segment(seq, 10 * i, 10 * (i + 1))]
            if i == k - 1 and draw(st.booleans()):
                lengths.append(3)
                segs.append(Segment(len(lengths) - 1, 0, 3))
            units.append(Unit(len(units), tuple(segs)))
    for _ in range(draw(st.integers(0, 5))):
        lengths.append(4)
        units.append(Unit(len(units), (Segment(len(lengths) - 1, 0, 4),)))
    return lengths, units


@settings(max_examples=150, deadline=None)
@given(unit_lists(), st.integers(1, 5), st.sampled_from(["epp", "1f1b", "gpipe"]))
def test_property_every_stage_complete_ordered_and_runnable(data, pp, kind):
    lengths, units = data
    bwd = backward_order(units, lengths)
    first_k = sum(1 for u in units if units[0].segments[0].seq in u.seqs)
    dims = ParallelDims(pp)
    warm = {"epp": epp_warmup(dims, first_k), "1f1b": one_f_one_b_warmup(dims), "gpipe": gpipe_warmup(dims, len(units))}[kind]
    acts = build_pipeline_actions([u.id for u in units], bwd, warm)
    chains = {}
    for u in units:
        for s in u.segments:
            chains.setdefault(s.seq, []).append((s.start, u.id))
    for stage in acts:
        assert sorted(str(a) for a in stage) == sorted([f"F{u.id}" for u in units] + [f"B{u.id}" for u in units])
        pos = {str(a): i for i, a in enumerate(stage)}
        for u in units:
            assert pos[f"F{u.id}"] < pos[f"B{u.id}"]
        for chain in chains.values():
            ids = [uid for _, uid in sorted(chain)]
            for e, l in zip(ids, ids[1:]):
                assert pos[f"F{e}"] < pos[f"F{l}"] and pos[f"B{l}"] < pos[f"B{e}"]
    for s in range(pp - 1):  # pairing: same F order and B order on neighbouring stages
        for kind_ in "FB":
            assert [a for a in acts[s] if a.kind == kind_] == [a for a in acts[s + 1] if a.kind == kind_]
    assert slot_replay(acts).complete  # deadlock-free
