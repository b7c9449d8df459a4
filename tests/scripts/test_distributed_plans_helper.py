"""The test helper ``tests/distributed/plans.py``: the hand-made 1F1B plans the distributed runtime
tests run are valid schedules."""
from __future__ import annotations

from tests.distributed.plans import make_plan

LENGTHS = [37, 11, 8, 5, 23, 6]
UNITS = [[[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37), (1, 0, 11)],
          [(4, 0, 15)], [(4, 15, 23), (2, 0, 8)], [(3, 0, 5), (5, 0, 6)]]]


def test_one_f_one_b_orders():
    plan = make_plan(LENGTHS, UNITS, 4, [1, 1, 1, 1])
    for s in range(4):
        acts = [str(a) for a in plan.stage_actions(0, s)]
        assert sorted(acts) == sorted([f"F{i}" for i in range(6)] + [f"B{i}" for i in range(6)])
        assert [a for a in acts if a[0] == "F"] == [f"F{i}" for i in range(6)]
        # slices backward last first, FIFO across sequences
        assert [a for a in acts if a[0] == "B"] == ["B2", "B1", "B0", "B4", "B3", "B5"]
        for i in range(6):
            assert acts.index(f"F{i}") < acts.index(f"B{i}")
    # warm-up: the last stage needs all three slices of seq 0 before its first backward
    assert [str(a) for a in plan.stage_actions(0, 3)][:4] == ["F0", "F1", "F2", "B2"]
    # stage 0 runs pp - 1 + (K - 1) = 5 forwards before its first backward
    assert [str(a) for a in plan.stage_actions(0, 0)][:6] == ["F0", "F1", "F2", "F3", "F4", "F5"]
