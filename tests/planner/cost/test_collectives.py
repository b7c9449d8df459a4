"""Collective times (planner/cost/collectives.py) against hand-computed alpha-beta figures."""
import pytest

from infinipipe_hf.planner.cost.collectives import (
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    all_to_all_time_two_level,
    reduce_scatter_time,
)

RING = (all_gather_time, reduce_scatter_time, all_to_all_time)


@pytest.mark.parametrize("fn", [*RING, all_reduce_time])
def test_one_rank_costs_nothing(fn):
    assert fn(1e9, 1, 100e9, 1e-5) == 0.0


def test_ring_by_hand():
    # 8 ranks, 8 GB tensor, 400 GB/s, 10 us per step: 7 steps of 1 GB each.
    want = 7 * 1e-5 + 7e9 / 400e9
    for fn in RING:
        assert fn(8e9, 8, 400e9, 1e-5) == pytest.approx(want, rel=1e-12)
    assert all_reduce_time(8e9, 8, 400e9, 1e-5) == pytest.approx(2 * want, rel=1e-12)


def test_two_ranks_move_half():
    assert all_gather_time(2e9, 2, 1e9, 0.0) == pytest.approx(1.0)


def test_two_level_all_to_all():
    # Inside one node it is the plain all-to-all.
    assert all_to_all_time_two_level(8e9, 8, 8, 400e9, 40e9, 1e-5) == pytest.approx(
        all_to_all_time(8e9, 8, 400e9, 1e-5), rel=1e-12)
    # 16 ranks on 2 nodes: 7/16 of the buffer stays on NVLink, 8/16 crosses InfiniBand; IB decides.
    got = all_to_all_time_two_level(16e9, 16, 8, 400e9, 40e9, 0.0)
    assert got == pytest.approx(8e9 / 40e9)
    # A group straddling nodes with one rank alone on its node: that rank sends 2/3 over IB.
    assert all_to_all_time_two_level(3e9, 3, 1, 400e9, 40e9, 0.0) == pytest.approx(2e9 / 40e9)


@pytest.mark.parametrize("args, match", [
    ((1e9, 0, 1e9, 0.0), "group_size"),
    ((-1.0, 2, 1e9, 0.0), "nbytes"),
    ((1e9, 2, 0.0, 0.0), "bandwidth"),
    ((1e9, 2, 1e9, -1.0), "latency"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        all_gather_time(*args)
