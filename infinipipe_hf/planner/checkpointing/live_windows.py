"""Which memory points' live sets contain a given point's: the solver's dominance windows.

Design: a unit is live on a contiguous run of a stage's memory points (its forward to its
backward), so containment of live sets reduces to interval arithmetic over first and last
appearances, computed in one pass with a lazy heap instead of comparing sets pairwise.  Kept
apart from :mod:`.points` (which prices the points) because only the checkpoint problem uses it
to drop dominated memory constraints.
"""
from __future__ import annotations

import heapq

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.planner.checkpointing.points import MemoryPoint


def live_windows(points: list[MemoryPoint], actions: list[Action]) -> tuple[list[int], list[int]]:
    """For each point, the range ``[first, last]`` of point indices whose live sets contain its own.

    ``points`` are :func:`memory_points` of a stage whose actions are ``actions``.  A unit is live
    on a contiguous run of points (its forward to its backward, or to the end without one), so
    point ``j``'s live set contains point ``i``'s exactly when ``j`` lies between the latest
    forward of ``i``'s live units and the earliest backward among them.  The solver uses this to
    drop dominated points in O(P log P) instead of comparing sets pairwise.
    """
    assert len(points) == len(actions), (len(points), len(actions))
    end = len(points) - 1
    first_seen: dict[int, int] = {}
    last_seen: dict[int, int] = {}
    for j, a in enumerate(actions):
        if a.unit in last_seen and last_seen[a.unit] < j or (a.is_forward and a.unit in first_seen):
            raise ValueError(f"unit {a.unit} is live on a broken window of this stage (action {a} at index {j} "
                             f"after its backward or a second forward); each unit needs exactly one F "
                             f"followed by one B per stage -- run the plan validator for details")
        first_seen.setdefault(a.unit, j)
        if a.is_forward:
            last_seen.setdefault(a.unit, end)
        else:
            last_seen[a.unit] = j
    firsts: list[int] = []
    lasts: list[int] = []
    # Live sets are ordered by forward time, so the newest unit sits last; the earliest expiry
    # needs a min over the set, kept in a lazy heap as units come and go.
    heap: list[tuple[int, int]] = []
    in_heap: set[int] = set()
    for j, p in enumerate(points):
        live = p.live_units
        if not live:
            firsts.append(j)
            lasts.append(j)
            continue
        newest = live[-1]  # only the newest unit can be one not seen before
        if newest not in in_heap:
            in_heap.add(newest)
            heapq.heappush(heap, (last_seen[newest], newest))
        while heap and last_seen[heap[0][1]] < j:
            in_heap.discard(heapq.heappop(heap)[1])
        firsts.append(first_seen[live[-1]])
        lasts.append(heap[0][0] if heap else j)
    return firsts, lasts
