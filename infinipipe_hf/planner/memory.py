"""Memory timeline of one stage: the bytes alive at the peak of each of its actions.

Design: a stage's memory at an action splits into a part that does not depend on checkpointing
(``base_bytes``: model states, the KV store, the working set of the running action) and the
activations of the *live* units (forwarded on this stage, backward not finished, the running
one included), each affine in its checkpointed-layer count.  A :class:`MemoryPoint` keeps the two
apart, so the checkpoint solver turns every point into one linear constraint and the simulator
and validator evaluate any checkpoint choice with :func:`point_bytes` without replaying the plan.

Trade-off: the backward working set is costed as if the running unit had at least one
checkpointed layer (its activations are rebuilt next to their gradients).  That over-estimates
units with no checkpointing by one layer's activations, but keeps ``base_bytes`` independent of
checkpoint choices, which is what makes every point a linear constraint.  The running unit's
activations count in full during its forward and backward (their peak is at the layer boundary).

KV store: a segment whose sequence continues holds ``cost.kv_bytes(stage, length)`` from its
forward on the stage until the backward of the unit holding the sequence's first slice
(``start == 0``) finishes there (backward runs last slice first, so that is the last user).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping

from .actions import Action
from .cost_model import CostModel
from .plan import Plan


@dataclass(frozen=True)
class MemoryPoint:
    """Memory of one stage at the peak of one of its actions."""

    action_index: int
    """Index into ``plan.stage_actions(dp_rank, stage)``."""
    base_bytes: float
    """Model states + KV store + working set of the running action; independent of checkpointing."""
    live_units: tuple[int, ...]
    """Units whose activations are held at that point (forward done or running, backward not
    finished), the running one included, in the order of their forwards."""


def _unit_facts(plan: Plan, cost: CostModel, stage: int, actions: list[Action]):
    """Per unit of the stage: (tokens, [(seq, KV bytes entering the store)], [seqs it frees])."""
    by_id = plan.unit_by_id
    facts: dict[int, tuple[int, list[tuple[int, float]], list[int]]] = {}
    for a in actions:
        uid = a.unit
        if uid in facts:
            continue
        unit = by_id.get(uid)
        if unit is None:
            raise ValueError(f"stage {stage} runs unit {uid}, which is not among the plan's units "
                             f"{sorted(by_id)[:10]}...; build actions from plan.units")
        tokens = 0
        kv_adds: list[tuple[int, float]] = []
        frees: list[int] = []
        for seg in unit.segments:
            n = seg.end - seg.start
            tokens += n
            if plan.continues_after(seg):
                kv_adds.append((seg.seq, cost.kv_bytes(stage, n)))
            if seg.start == 0:
                frees.append(seg.seq)  # the first slice's backward is the sequence's last
        facts[uid] = (tokens, kv_adds, frees)
    return facts


def memory_points(plan: Plan, cost: CostModel, dp_rank: int, stage: int) -> list[MemoryPoint]:
    """One :class:`MemoryPoint` per action of ``plan.stage_actions(dp_rank, stage)``, in order."""
    if not 0 <= stage < plan.pp_degree:
        raise ValueError(f"stage {stage} out of range for pp_degree {plan.pp_degree}; use 0..{plan.pp_degree - 1}")
    if dp_rank not in plan.actions:
        raise ValueError(f"dp_rank {dp_rank} not in the plan (dp ranks {sorted(plan.actions)})")
    actions = plan.stage_actions(dp_rank, stage)
    facts = _unit_facts(plan, cost, stage, actions)
    static = cost.static_bytes(stage)
    kv_by_seq: dict[int, float] = {}
    kv_total = 0.0
    live: dict[int, None] = {}  # insertion-ordered set: forwards arrive in time order
    points: list[MemoryPoint] = []
    for i, a in enumerate(actions):
        tokens, kv_adds, frees = facts[a.unit]
        if a.is_forward:
            # The new K/V exist as soon as the forward has run its first layer.
            for seq, b in kv_adds:
                kv_by_seq[seq] = kv_by_seq.get(seq, 0.0) + b
                kv_total += b
            live[a.unit] = None
            work = cost.working_bytes(stage, tokens, 0, backward=False)
            points.append(MemoryPoint(i, static + kv_total + work, tuple(live)))
        else:
            # A backward without its forward is the validator's to report; count the unit live
            # while it runs so the point is still conservative.
            live.setdefault(a.unit, None)
            work = cost.working_bytes(stage, tokens, 1, backward=True)
            points.append(MemoryPoint(i, static + kv_total + work, tuple(live)))
            del live[a.unit]
            for seq in frees:
                kv_total -= kv_by_seq.pop(seq, 0.0)
    return points


def point_bytes(point: MemoryPoint, plan: Plan, cost: CostModel, stage: int,
                checkpoint_layers: Mapping[int, int]) -> float:
    """Bytes of ``point`` on ``stage`` when unit ``u`` checkpoints ``checkpoint_layers.get(u, 0)`` layers."""
    by_id = plan.unit_by_id
    total = point.base_bytes
    for uid in point.live_units:
        total += cost.activation_bytes(stage, by_id[uid].num_tokens, checkpoint_layers.get(uid, 0))
    return total


def stage_peak_bytes(plan: Plan, cost: CostModel, dp_rank: int, stage: int,
                     checkpoint_layers: Mapping[int, int] | None = None, *,
                     points: list[MemoryPoint] | None = None) -> float:
    """Peak over the stage's actions of :func:`point_bytes` (``plan.checkpoint_layers`` by default).

    ``points`` may pass :func:`memory_points` of the same stage when the caller has them.  Keeps a
    running sum of live activations instead of summing every point's live set, so it is linear in
    the number of actions even for GPipe-like schedules where everything is live.
    """
    if checkpoint_layers is None:
        checkpoint_layers = plan.checkpoint_layers.get(stage, {})
    if points is None:
        points = memory_points(plan, cost, dp_rank, stage)
    if not points:
        return cost.static_bytes(stage)
    actions = plan.stage_actions(dp_rank, stage)
    assert len(points) == len(actions), "points are not this stage's"
    by_id = plan.unit_by_id
    act: dict[int, float] = {}
    live_sum = 0.0
    peak = float("-inf")
    for p in points:
        a = actions[p.action_index]
        if a.unit not in act:
            act[a.unit] = cost.activation_bytes(stage, by_id[a.unit].num_tokens, checkpoint_layers.get(a.unit, 0))
            live_sum += act[a.unit]
        peak = max(peak, p.base_bytes + live_sum)
        if not a.is_forward:
            live_sum -= act.pop(a.unit)
    return peak


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
