"""Rounds on the runtime's side: which actions each SP rank runs, and the checks the engine adds to
the validator's (pure: no process group; the validator's round checks are tested with it)."""
import dataclasses

import pytest

from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.runtime.engine.sp_rounds import check_runnable, rank_actions
from tests.distributed.round_plans import rounds_plan

LENGTHS = [20, 9, 7, 5, 12, 3, 4]
# Round 0: seq 0's first slice on all 4 ranks; round 1: its tail with seq 1 (hybrid) on all 4;
# round 2: seq 4's first slice on ranks 0-1, seq 2 on rank 2, seq 3 on rank 3; round 3: seq 4's
# tail on ranks 0-1, seqs 5 and 6 on ranks 2 and 3.
ROUNDS = [[(0, 4, [(0, 0, 12)])], [(0, 4, [(0, 12, 20), (1, 0, 9)])],
          [(0, 2, [(4, 0, 7)]), (2, 1, [(2, 0, 7)]), (3, 1, [(3, 0, 5)])],
          [(0, 2, [(4, 7, 12)]), (2, 1, [(5, 0, 3)]), (3, 1, [(6, 0, 4)])]]


def plan(pp=2, rounds=ROUNDS, **kw):
    return rounds_plan(LENGTHS, [rounds], pp=pp, sp=4, layers_per_stage=[2] * pp, **kw)


def round_sequence(p, stage, sp_rank):
    of = {u: r for r, members in enumerate(p.rounds) for u in members}
    return [(a.kind, of[a.unit]) for a in rank_actions(p, 0, stage, sp_rank)]


def test_each_sp_rank_runs_its_units_and_every_rank_the_same_rounds_in_order():
    p = plan()
    check_runnable(p, ParallelDims(sp_degree=4))
    assert p.rounds == [[0], [1], [2, 3, 4], [5, 6, 7]]
    assert p.sp_groups == {2: SubGroup(0, 2), 3: SubGroup(2, 1), 4: SubGroup(3, 1),
                           5: SubGroup(0, 2), 6: SubGroup(2, 1), 7: SubGroup(3, 1)}
    for stage in range(2):
        units = [{a.unit for a in rank_actions(p, 0, stage, r)} for r in range(4)]
        assert units == [{0, 1, 2, 5}, {0, 1, 2, 5}, {0, 1, 3, 6}, {0, 1, 4, 7}]
        seqs = [round_sequence(p, stage, r) for r in range(4)]
        assert all(s == seqs[0] for s in seqs) and len(seqs[0]) == 8


def test_a_plan_without_sub_groups_runs_every_action_on_every_rank():
    p = dataclasses.replace(plan(), sp_groups={}, rounds=[])
    assert rank_actions(p, 0, 1, 3) == p.stage_actions(0, 1)
    check_runnable(p, ParallelDims(sp_degree=4))
    check_runnable(dataclasses.replace(p, sp_degree=1), ParallelDims(sp_degree=2))  # sp_degree unchecked as today


def test_sp_degree_must_match_and_be_above_one():
    with pytest.raises(ValueError, match="sp_degree=4 but the engine runs sp_degree=2"):
        check_runnable(plan(), ParallelDims(sp_degree=2))
    p = rounds_plan([3, 2], [[[(0, 1, [(0, 0, 3)])], [(0, 1, [(1, 0, 2)])]]], pp=1, sp=1, layers_per_stage=[2])
    p.sp_groups = {0: SubGroup(0, 1)}
    with pytest.raises(ValueError, match="rounds need sp_degree >= 2"):
        check_runnable(p, ParallelDims(sp_degree=1))


def test_rounds_must_cover_the_sp_ranks_and_stay_in_one_replica():
    p = plan()
    p.rounds = [[0], [1], [2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="the plan's rounds cannot run: round 2 .* covers SP ranks"):
        check_runnable(p, ParallelDims(sp_degree=4))
    p = plan()
    p.rounds = []  # each unit its own round: the sub-group units do not cover the ranks
    with pytest.raises(ValueError, match="covers SP ranks"):
        check_runnable(p, ParallelDims(sp_degree=4))
    p = plan()
    p.units[3] = dataclasses.replace(p.units[3], dp_rank=1)
    with pytest.raises(ValueError, match=r"round 2 \(units \[2, 3, 4\]\) mixes DP replicas \[0, 1\]"):
        check_runnable(p, ParallelDims(sp_degree=4))


def test_aligned_sub_groups_and_the_sizes_that_need_a_process_group():


    assert [ParallelDims(sp_degree=n).sub_group_sizes for n in (1, 2, 4, 6, 8)] == [[], [], [2], [2], [2, 4]]
    spec = ParallelDims(pp_degree=2, sp_degree=4)
    assert spec.sub_groups(2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spec.sub_group(0, 1, 2, 2) == [6, 7] and spec.sub_group(0, 1, 3, 1) == [7]
    assert spec.sub_group(0, 0, 0, 4) == spec.sp_group(0, 0)
