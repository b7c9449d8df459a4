"""Pipeline grouping DP: optimal against brute force over every contiguous partition; call count."""
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinipipe_hf.planner.pipeline.grouping import group_pipelines


def _brute(blocks, time):
    g = len(blocks)
    best = math.inf
    for cuts in itertools.product([0, 1], repeat=g - 1):
        parts, cur = [], list(blocks[0])
        for b, c in zip(blocks[1:], cuts):
            if c:
                parts.append(cur)
                cur = list(b)
            else:
                cur += b
        parts.append(cur)
        best = min(best, sum(time(p) for p in parts))
    return best


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=7), st.integers(0, 10_000), st.floats(0.0, 5.0))
def test_dp_matches_brute_force(sizes, seed, fill):
    blocks, uid = [], 0
    for n in sizes:
        blocks.append(list(range(uid, uid + n)))
        uid += n
    weight = {u: ((seed * 7919 + u * 104729) % 97) / 10 for u in range(uid)}

    def time(ids):  # fill/drain per pipeline plus a superlinear in-flight penalty
        w = sum(weight[u] for u in ids)
        return fill + w + 0.05 * len(ids) ** 2

    got = group_pipelines(blocks, time)
    assert [u for p in got for u in p] == list(range(uid))  # contiguous, in order, each once
    starts = {b[0] for b in blocks}
    assert all(p[0] in starts for p in got)  # unions of whole blocks
    assert sum(time(p) for p in got) == pytest.approx(_brute(blocks, time))


def test_calls_are_cached_and_quadratic():
    calls = []

    def time(ids):
        calls.append(tuple(ids))
        return 1.0 + len(ids) ** 2

    got = group_pipelines([[0], [1], [2], [3]], time)
    assert len(calls) == len(set(calls)) == 10  # G(G+1)/2 distinct pipelines
    assert got == [[0], [1], [2], [3]]


def test_prefers_one_pipeline_when_fill_dominates_and_handles_infeasible():
    assert group_pipelines([[0, 1], [2]], lambda ids: 10.0 + len(ids)) == [[0, 1, 2]]
    # The whole batch as one pipeline does not fit (inf): split.
    assert group_pipelines([[0, 1], [2]], lambda ids: math.inf if len(ids) > 2 else 1.0) == [[0, 1], [2]]
    assert group_pipelines([], lambda ids: 1.0) == []
    with pytest.raises(ValueError, match="empty block"):
        group_pipelines([[0], []], lambda ids: 1.0)
