"""The runtime's rank layout (``ParallelLayout``): coordinates, neighbours and groups of each rank,
world checks; pure arithmetic, no process groups."""
from __future__ import annotations

import pytest

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout


def test_layout_coordinates_dp2_pp4():
    lays = [ParallelLayout(ParallelDims(pp_degree=4, dp_degree=2), r, groups_enabled=False) for r in range(8)]
    assert [(l.dp_rank, l.stage_index) for l in lays] == [(d, s) for d in range(2) for s in range(4)]
    l5 = lays[5]
    assert (l5.prev_rank, l5.next_rank) == (4, 6)
    assert lays[4].prev_rank is None and lays[7].next_rank is None
    assert l5.dp_ranks_of_stage(1) == [1, 5] and l5.pp_ranks_of_replica(1) == [4, 5, 6, 7]
    assert l5.describe() == "rank 5 (stage 1, dp 1)"


def test_layout_coordinates_dp2_pp2_sp2():
    # rank = (dp_rank * pp_degree + stage_index) * sp_degree + sp_rank: SP ranks adjacent.
    lays = [ParallelLayout(ParallelDims(2, 2, 2), r, groups_enabled=False) for r in range(8)]
    assert [(l.dp_rank, l.stage_index, l.sp_rank) for l in lays] == [
        (d, s, r) for d in range(2) for s in range(2) for r in range(2)]
    l5 = lays[5]  # dp 1, stage 0, sp 1
    assert (l5.prev_rank, l5.next_rank) == (None, 7)
    assert lays[7].prev_rank == 5
    assert l5.dp_ranks_of_stage(0) == [1, 5] and l5.pp_ranks_of_replica(1) == [5, 7]
    assert l5.sp_ranks_of_stage(1, 0) == [4, 5]
    assert l5.grad_ranks_of_stage(1) == [2, 3, 6, 7]
    assert l5.describe() == "rank 5 (stage 0, dp 1, sp 1)"
    assert all(l.global_rank(l.dp_rank, l.stage_index) == l.rank for l in lays)


def test_layout_rejects_a_rank_outside_its_world():
    with pytest.raises(ValueError, match="rank 8 is outside world size 8"):
        ParallelLayout(ParallelDims(pp_degree=4, dp_degree=2), 8, groups_enabled=False)


def test_tied_pair_only_across_stages():
    assert ParallelLayout(ParallelDims(pp_degree=2), 0, tied_embeddings=True, groups_enabled=False).has_tied_pair
    assert not ParallelLayout(ParallelDims(dp_degree=2), 0, tied_embeddings=True, groups_enabled=False).has_tied_pair
