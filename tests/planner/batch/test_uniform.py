"""Baseline unit makers (planner/batch/uniform.py, packing.py): coverage, packing length, first-fit
quality, equal-token and equal-compute slices, and their search grids."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.uniform import (
    equal_compute_slices,
    layer_pair_weight,
    make_packed_units,
    make_uniform_slices,
    pack_sequences,
    uniform_token_slices,
)
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.grids import packing_candidates, slicing_candidates

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
COST = CostModel(ModelSpec.from_config_dict(LLAMA3_8B), dims=ParallelDims(pp_degree=4))

lengths_st = st.lists(st.one_of(st.integers(1, 100), st.integers(1, 20_000)), min_size=1, max_size=40)


def covered(units, lengths, seqs):
    """Every token of every chosen sequence in exactly one segment, in order."""
    got: dict[int, list[tuple[int, int]]] = {}
    for u in units:
        for s in u.segments:
            got.setdefault(s.seq, []).append((s.start, s.end))
    assert sorted(got) == sorted(seqs)
    for s, spans in got.items():
        assert spans[0][0] == 0 and spans[-1][1] == lengths[s]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, pack=st.integers(1, 40_000), first=st.integers(0, 9))
def test_packed_units(lengths, pack, first):
    units = make_packed_units(lengths, COST, pack, first_unit_id=first)
    assert [u.id for u in units] == list(range(first, first + len(units)))
    covered(units, lengths, range(len(lengths)))
    assert all(s.start == 0 and s.end == lengths[s.seq] for u in units for s in u.segments)
    normal = []
    for u in units:
        if u.num_tokens > pack:
            assert len(u.segments) == 1  # an oversized sequence alone, never cut
        else:
            normal.append(u.num_tokens)
    # first fit: no two micro-batches could have been merged
    for i in range(len(normal)):
        for j in range(i + 1, len(normal)):
            assert normal[i] + normal[j] > pack


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, pack=st.integers(1, 40_000), k=st.integers(1, 16), data=st.data())
def test_uniform_slices(lengths, pack, k, data):
    seqs = data.draw(st.lists(st.sampled_from(range(len(lengths))), min_size=1, unique=True))
    units = make_uniform_slices(lengths, COST, pack, k, seqs=seqs)
    covered(units, lengths, seqs)
    bins = pack_sequences(lengths, pack, seqs)
    pos = 0
    for b in bins:
        tokens = sum(lengths[s] for s in b)
        n = min(k, tokens)
        group = units[pos:pos + n]  # a micro-batch's slices are consecutive
        pos += n
        sizes = [u.num_tokens for u in group]
        assert sum(sizes) == tokens and max(sizes) - min(sizes) <= 1
        assert {s.seq for u in group for s in u.segments} == set(b)
    assert pos == len(units)


def test_uniform_slice_crosses_document_boundary_with_context():
    units = make_uniform_slices([6, 4], COST, 10, 2)
    assert [[s.to_list() for s in u.segments] for u in units] == [[[0, 0, 5]], [[0, 5, 6], [1, 0, 4]]]


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, pack=st.integers(1, 40_000), k=st.integers(1, 16), floor=st.integers(1, 2048),
       data=st.data())
def test_equal_compute_slices(lengths, pack, k, floor, data):
    seqs = data.draw(st.lists(st.sampled_from(range(len(lengths))), min_size=1, unique=True))
    units = make_uniform_slices(lengths, COST, pack, k, seqs=seqs, balance="compute", min_tokens=floor)
    covered(units, lengths, seqs)
    pos = 0
    for b in pack_sequences(lengths, pack, seqs):
        tokens = sum(lengths[s] for s in b)
        n = min(k, tokens)
        group = units[pos:pos + n]  # a micro-batch's slices are consecutive, in token order
        pos += n
        assert sum(u.num_tokens for u in group) == tokens
        assert min(u.num_tokens for u in group) >= min(floor, tokens // n)
        assert [s.seq for u in group for s in u.segments if s.start == 0] == list(b)
    assert pos == len(units)


def _layer_times(units, cost=COST):
    shapes = [UnitShape.of(u.segments) for u in units]
    return [cost.coefficients.layer_fwd(sh.pairs, sh.tokens) + cost.coefficients.layer_bwd(sh.pairs, sh.tokens) for sh in shapes]


@pytest.mark.parametrize("n, k", [(32768, 4), (65536, 8), (131072, 4)])
def test_equal_compute_slices_balance_layer_time_better_than_equal_tokens(n, k):
    by_tokens = _layer_times(make_uniform_slices([n], COST, n, k))
    by_compute = make_uniform_slices([n], COST, n, k, balance="compute", min_tokens=256)
    times = _layer_times(by_compute)
    assert max(times) / min(times) < 1.001 < max(by_tokens) / min(by_tokens)
    sizes = [u.num_tokens for u in by_compute]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > n // k > sizes[-1]  # later slices are shorter


def test_equal_compute_without_attention_or_room_and_with_a_floor():
    members = [(0, 1000), (1, 24)]
    sizes = lambda cut: [sum(s.length for s in segs) for segs in cut]  # noqa: E731
    assert sizes(equal_compute_slices(members, 4, 0.0)) == [256] * 4
    assert sizes(equal_compute_slices(members, 4, 1.0, min_tokens=256)) == [256] * 4  # the floor binds
    assert sizes(uniform_token_slices(members, 4)) == [256] * 4
    # Attention-bound: cuts near 1000 * sqrt(j / 4); a floor of 200 holds the last three slices.
    assert sizes(equal_compute_slices(members, 4, 1.0)) == [500, 207, 159, 158]
    assert sizes(equal_compute_slices(members, 4, 1.0, min_tokens=200)) == [424, 200, 200, 200]


def test_equal_compute_slices_cross_document_boundaries_with_context():
    # Two documents in one micro-batch, cut where the work (tokens + pairs) splits evenly.
    cut = equal_compute_slices([(0, 6), (1, 4)], 2, 1.0)
    assert [[s.to_list() for s in segs] for segs in cut] == [[[0, 0, 5]], [[0, 5, 6], [1, 0, 4]]]
    assert layer_pair_weight(COST) > 0


def test_packing_candidates_grid():
    lengths = [5000, 3000, 2000] + [700] * 40
    cands = packing_candidates(lengths)
    assert cands[0] == 5000 and cands == sorted(set(cands))
    assert all(c & (c - 1) == 0 for c in cands[1:])  # powers of two above the longest
    assert cands[-1] <= sum(lengths)
    assert packing_candidates([10, 20]) == [1024]


def test_slicing_candidates_keep_slices_large_enough():
    assert slicing_candidates([100_000], ParallelDims()) == [1, 2, 4, 8, 16, 32, 64]
    assert slicing_candidates([1000], ParallelDims()) == [1, 2]
    assert slicing_candidates([1000], ParallelDims(), pack_tokens=4096) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("call, match", [
    (lambda: make_packed_units([10], COST, 0), "pack_tokens"),
    (lambda: make_uniform_slices([10], COST, 10, 0), "num_slices"),
    (lambda: make_uniform_slices([10], COST, 10, 2, balance="flops"), "balance='flops' is not a slice balance"),
    (lambda: make_packed_units([], COST, 10), "no sequences"),
])
def test_user_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
