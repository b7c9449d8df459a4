"""Elastic SP rounds from EPP's units: chains whole, short sequences on the smallest sub-group that
holds them, rounds that cover the SP group, deterministic."""
import pytest

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.elastic import make_elastic_units
from infinipipe_hf.planner.batch.layer_time import LayerTime
from infinipipe_hf.planner.batch.sub_groups import _assemble, _Member, elastic_rounds, group_sizes
from infinipipe_hf.planner.cost.model import CostModel
from tests.planner.hand_plans import LLAMA8B

LENGTHS = [60000, 30000, 9000, 5000, 4000] + [900 + 37 * i for i in range(40)] + [3000, 2500, 2000]


def _rounded(lengths, sp=8, k=4, floor=None):
    cost = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=4, sp_degree=sp, shard="sp"))
    res = make_elastic_units(lengths, cost, k, min_token_budget=floor)
    return res, elastic_rounds(res, lengths, cost, first_unit_id=7), cost


def test_rounds_cover_the_sp_group_and_every_sequence_once():
    res, rounded, cost = _rounded(LENGTHS)
    ids = [u.id for u in rounded.units]
    assert ids == list(range(7, 7 + len(ids)))
    Plan("epp", 4, 1, list(LENGTHS), rounded.units, {0: [[]] * 4}, {}, sp_degree=8, sp_groups=rounded.sp_groups,
         rounds=rounded.rounds).check_rounds()
    assert [u for r in rounded.rounds for u in r] == ids  # forward order: round by round
    tokens = sorted((s.seq, s.start, s.end) for u in rounded.units for s in u.segments)
    assert tokens == sorted((s.seq, s.start, s.end) for u in res.units for s in u.segments)


def test_chains_stay_on_the_whole_group_and_short_sequences_take_small_ones():
    res, rounded, _ = _rounded(LENGTHS)
    per_rank = res.token_budget / 8
    by_id = {u.id: u for u in rounded.units}
    sliced = {s.seq for u in res.units for s in u.segments if s.start > 0}
    assert sliced  # the batch has chains
    for u in rounded.units:
        g = rounded.sp_groups.get(u.id)
        if any(s.seq in sliced for s in u.segments):
            assert g is None, "slices and hybrids run on the whole SP group"
            continue
        size = g.size if g else 8
        assert u.num_tokens <= per_rank * size  # no rank holds more than a whole-group unit puts on it
        assert all(s.start == 0 for s in u.segments)
    assert rounded.group_sizes().get(1, 0) >= 5  # short sequences on one GPU each
    singles = [by_id[u] for u, g in rounded.sp_groups.items() if g.size == 1]
    assert max(u.num_tokens for u in singles) <= per_rank


def test_rounds_are_deterministic():
    a = _rounded(LENGTHS)[1]
    b = _rounded(list(LENGTHS))[1]
    assert a == b


def test_no_rounds_where_nothing_would_run_on_a_sub_group():
    assert _rounded([60000, 50000, 40000], k=8)[1] is None  # only chains
    assert _rounded(LENGTHS, sp=6)[1] is None  # aligned sub-groups only tile a power of two
    assert [group_sizes(ParallelDims(sp_degree=n)) for n in (8, 6, 1)] == [[1, 2, 4, 8], [], []]


@pytest.mark.parametrize("sp", [2, 4])
def test_a_partial_round_grows_its_units_to_cover_the_group(sp):
    cost = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=4, sp_degree=sp))
    times = {g: LayerTime.of(cost.for_group(g)) for g in group_sizes(cost.dims)}
    members = [_Member(1, [q], times[1].b + times[1].segment(0, 4000 - 100 * q), 4000 - 100 * q) for q in range(sp + 1)]
    rounds = _assemble(members, times, [4000 - 100 * q for q in range(sp + 1)])
    assert [[m.size for m in r] for r in rounds] == [[1] * sp, [sp]]  # the last unit alone grew to the group
    assert rounds[1][0].time < times[1].b + times[1].segment(0, 4000 - 100 * sp)  # and runs faster so
