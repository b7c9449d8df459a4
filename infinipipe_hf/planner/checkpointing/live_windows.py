"""Which memory points' live sets contain a given point's: the solver's dominance windows.

Design: a unit is live on a contiguous run of a stage's memory points (its forward to its
backward), so containment of live sets reduces to interval arithmetic over first and last
appearances, computed in one pass with a lazy heap instead of comparing sets pairwise.  Kept
apart from :mod:`.points` (which prices the points) because only the checkpoint problem uses it
to drop dominated memory constraints.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from infinipipe_hf.ir.actions import Action

if TYPE_CHECKING:  # points builds on the memory walk, which takes live_intervals from here
    pass


def live_windows(points: list, actions: list[Action]) -> tuple[list[int], list[int]]:
    """For each point, the range ``[first, last]`` of point indices whose live sets contain its own.

    ``points`` are :func:`.points.memory_points` of a stage whose actions are ``actions``.  A unit is live
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


def timeline_windows(timeline) -> tuple[np.ndarray, np.ndarray]:
    """:func:`live_windows` of a regular :class:`~.memory_walk.StageTimeline`, as arrays."""
    assert timeline.regular, "live windows of an irregular timeline: use live_windows"
    n = len(timeline.actions)
    firsts = np.arange(n)
    lasts = np.arange(n)
    fpos, bpos = timeline.fpos.tolist(), timeline.bpos.tolist()
    # firsts[j]: latest forward among the units live at j -- paint intervals by rising forward
    # index, later paints win.  lasts[j]: earliest backward among them -- paint by falling
    # backward index.
    for f, b in zip(fpos, bpos):
        firsts[f:b + 1] = f
    for k in np.argsort(-timeline.bpos, kind="stable").tolist():
        lasts[fpos[k]:bpos[k] + 1] = bpos[k]
    return firsts, lasts


def live_intervals(nu: int, slot: np.ndarray, fwd: np.ndarray) -> tuple[bool, np.ndarray | None, np.ndarray | None]:
    """(regular, forward index, backward index) of every unit; the indices only when regular."""
    if not len(slot):
        return False, None, None
    f_units, b_units = slot[fwd], slot[~fwd]
    if len(f_units) != nu or len(b_units) != nu:
        return False, None, None
    fpos = np.full(nu, -1, dtype=np.int64)
    bpos = np.full(nu, -1, dtype=np.int64)
    fpos[f_units] = np.flatnonzero(fwd)
    bpos[b_units] = np.flatnonzero(~fwd)
    if (fpos >= 0).all() and (bpos >= 0).all() and (fpos < bpos).all():
        return True, fpos, bpos
    return False, None, None
