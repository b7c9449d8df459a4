"""Baseline unit makers (planner/batch/uniform.py, packing.py): coverage, packing length, first-fit
quality, equal-token slices, and their search grids."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.batch.uniform import make_packed_units, make_uniform_slices, pack_sequences
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.schedules.grids import packing_candidates, slicing_candidates

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
COST = CostModel(ModelSpec.from_config_dict(LLAMA3_8B), pp_degree=4)

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


def test_packing_candidates_grid():
    lengths = [5000, 3000, 2000] + [700] * 40
    cands = packing_candidates(lengths)
    assert cands[0] == 5000 and cands == sorted(set(cands))
    assert all(c & (c - 1) == 0 for c in cands[1:])  # powers of two above the longest
    assert cands[-1] <= sum(lengths)
    assert packing_candidates([10, 20]) == [1024]


def test_slicing_candidates_keep_slices_large_enough():
    assert slicing_candidates([100_000]) == [1, 2, 4, 8, 16, 32, 64]
    assert slicing_candidates([1000]) == [1, 2]
    assert slicing_candidates([1000], pack_tokens=4096) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("call, match", [
    (lambda: make_packed_units([10], COST, 0), "pack_tokens"),
    (lambda: make_uniform_slices([10], COST, 10, 0), "num_slices"),
    (lambda: make_packed_units([], COST, 10), "no sequences"),
])
def test_user_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
