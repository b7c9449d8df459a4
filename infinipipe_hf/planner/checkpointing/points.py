"""Memory points of one stage: the bytes at the peak of each action, and the stage's peak.

A :class:`MemoryPoint` keeps a point's checkpoint-independent ``base_bytes`` apart from its live
units (:mod:`.timeline` explains the split), so the checkpoint solver turns every point into one
linear constraint and the simulator and validator evaluate any checkpoint choice with
:func:`point_bytes`.  :func:`stage_peak_bytes` takes the peak over a stage through its
:class:`~.timeline.StageTimeline` (a cumulative sum) or, given the points, through a running sum
of live activations.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import has_sub_groups, rank_classes, rank_view
from infinipipe_hf.planner.checkpointing.memory_walk import (
    LevelCounts,
    StageTimeline,
    checkpoints_nothing,
    finer_bytes,
    phase_model,
    rebuilt_bytes,
    stage_timeline,
    unit_tiles,
)
from infinipipe_hf.planner.cost.model import CostModel, unit_cost_map


class MemoryPoint(NamedTuple):
    """Memory of one stage at the peak of one of its actions (a named tuple: the planner builds
    one per action of every stage it walks)."""

    action_index: int
    """Index into ``plan.stage_actions(dp_rank, stage)``."""
    base_bytes: float
    """Model states + KV store + working set of the running action; independent of checkpointing."""
    live_units: tuple[int, ...]
    """Units whose activations are held at that point (forward done or running, backward not
    finished), the running one included, in the order of their forwards."""
    running_unit: int | None = None
    """The unit of the action at this point (its working memory is part of ``base_bytes``)."""
    forward: bool = True
    """Whether that action is a forward."""
    host_bytes: float = 0.0
    """Host bytes independent of checkpointing (states on the host, an offloaded KV store); the live
    units' offloaded inputs come on top (:mod:`.host_peak`)."""


def memory_points(plan: Plan, cost: CostModel, dp_rank: int, stage: int, cache: dict | None = None) -> list[MemoryPoint]:
    """One :class:`MemoryPoint` per action of ``plan.stage_actions(dp_rank, stage)``, in order
    (``cache``: see :func:`stage_timeline`)."""
    return timeline_points(stage_timeline(plan, cost, dp_rank, stage, cache))


def timeline_points(tl: StageTimeline) -> list[MemoryPoint]:
    """The :class:`MemoryPoint` list of a :class:`StageTimeline` (what :func:`memory_points` returns)."""
    units = tl.units.tolist()
    live: dict[int, None] = {}  # insertion-ordered set: forwards arrive in time order
    points: list[MemoryPoint] = []
    host = tl.host_base.tolist() if tl.host_base is not None else [0.0] * len(tl.actions)
    for i, (k, fw, base) in enumerate(zip(tl.slot.tolist(), tl.forward.tolist(), tl.base.tolist())):
        u = units[k]
        if fw:
            live[u] = None
            points.append(MemoryPoint(i, base, tuple(live), u, True, host[i]))
        else:
            # A backward without its forward is the validator's to report; count the unit live
            # while it runs so the point is still conservative.
            live.setdefault(u, None)
            points.append(MemoryPoint(i, base, tuple(live), u, False, host[i]))
            del live[u]
    return points


def _tiled(tiled: bool) -> dict:
    """Keyword of a unit whose MLP runs in tiles (none otherwise: stand-in cost models take none)."""
    return {"mlp_tiled": True} if tiled else {}


def point_bytes(point: MemoryPoint, plan: Plan, cost: CostModel, stage: int,
                checkpoint_layers: Mapping[int, int], checkpoint_levels: LevelCounts | None = None) -> float:
    """Bytes of ``point`` on ``stage`` when unit ``u`` checkpoints ``checkpoint_layers.get(u, 0)`` layers
    (and the finer levels ``checkpoint_levels.get(u)``)."""
    by_id = plan.unit_by_id
    levels = checkpoint_levels or {}
    groups = unit_cost_map(plan, cost) if plan.sp_groups else {}
    total = point.base_bytes
    if phase_model(cost) is not None and point.running_unit is not None:
        u = point.running_unit
        total += groups.get(u, cost).working.correction(stage, by_id[u].segments, checkpoint_layers.get(u, 0),
                                                        levels.get(u))[0 if point.forward else 1]
    elif point.running_unit is not None and not point.forward and checkpoints_nothing(checkpoint_layers, levels):
        total -= _unrebuilt(groups.get(point.running_unit, cost), stage, plan, point.running_unit)
    for uid in point.live_units:
        segs = by_id[uid].segments
        c = groups.get(uid, cost)
        tiled = uid in plan.mlp_tile_tokens  # stand-in cost models take no tile
        total += (c.acts.unit_activation_bytes(stage, segs, checkpoint_layers.get(uid, 0), **_tiled(tiled))
                  - finer_bytes(c, stage, segs, levels.get(uid), tiled))
    return total


def stage_peak_bytes(plan: Plan, cost: CostModel, dp_rank: int, stage: int,
                     checkpoint_layers: Mapping[int, int] | None = None, *,
                     checkpoint_levels: LevelCounts | None = None,
                     points: list[MemoryPoint] | None = None,
                     timeline: StageTimeline | None = None) -> float:
    """Peak over the stage's actions of :func:`point_bytes` (the plan's ``checkpoint_layers`` and
    ``checkpoint_levels`` when ``checkpoint_layers`` is not given; else none of the finer levels
    unless ``checkpoint_levels`` is).

    ``points`` may pass :func:`memory_points` of the same stage, or ``timeline`` its
    :func:`stage_timeline`, when the caller has them.  Keeps a running sum of live activations
    instead of summing every point's live set, so it is linear in the number of actions even for
    GPipe-like schedules where everything is live.
    """
    if checkpoint_layers is None:
        checkpoint_layers = plan.checkpoint_layers.get(stage, {})
        if checkpoint_levels is None:
            checkpoint_levels = plan.checkpoint_levels.get(stage, {})
    levels = checkpoint_levels or {}
    if points is None and timeline is None and has_sub_groups(plan):  # the stage's busiest SP rank
        cache: dict = {}
        views = [rank_view(plan, rank) for rank in rank_classes(plan)]
        return max(stage_peak_bytes(v, cost, dp_rank, stage, checkpoint_layers, checkpoint_levels=levels,
                                    timeline=stage_timeline(v, cost, dp_rank, stage, cache)) for v in views)
    if points is None:
        if timeline is None:
            timeline = stage_timeline(plan, cost, dp_rank, stage)
        assert timeline.actions is plan.stage_actions(dp_rank, stage), "timeline is not this stage's"
        return timeline.peak(cost, stage, checkpoint_layers, levels)
    if not points:
        return cost.acts.static_bytes(stage)
    actions = plan.stage_actions(dp_rank, stage)
    assert len(points) == len(actions), "points are not this stage's"
    by_id = plan.unit_by_id
    groups = unit_cost_map(plan, cost) if plan.sp_groups else {}
    act: dict[int, float] = {}
    live_sum = 0.0
    peak = float("-inf")
    nothing = checkpoints_nothing(checkpoint_layers, levels)  # once: the same for every point
    for p in points:
        a = actions[p.action_index]
        c = groups.get(a.unit, cost)
        if a.unit not in act:
            segs = by_id[a.unit].segments
            tiled = a.unit in plan.mlp_tile_tokens
            act[a.unit] = (c.acts.unit_activation_bytes(stage, segs, checkpoint_layers.get(a.unit, 0), **_tiled(tiled))
                           - finer_bytes(c, stage, segs, levels.get(a.unit), tiled))
            live_sum += act[a.unit]
        base = p.base_bytes
        if phase_model(cost) is not None:
            base += c.working.correction(stage, by_id[a.unit].segments, checkpoint_layers.get(a.unit, 0),
                                         levels.get(a.unit))[0 if a.is_forward else 1]
        elif nothing and not a.is_forward:
            base -= _unrebuilt(c, stage, plan, a.unit)
        peak = max(peak, base + live_sum)
        if not a.is_forward:
            live_sum -= act.pop(a.unit)
    return peak


def _unrebuilt(cost: CostModel, stage: int, plan: Plan, unit: int) -> float:
    """What a backward point's base counts for a layer its unit does not rebuild, taken off where the
    stage checkpoints nothing (``StageTimeline.unrebuilt``)."""
    return rebuilt_bytes(cost, stage, plan.unit_by_id[unit].num_tokens, unit_tiles(plan, unit))


def fits_unchecked(plan: Plan, cost: CostModel, problem, slack_bytes: float = 0.0) -> bool:
    """Whether a replica's checkpoint ``problem`` (a ``ReplicaProblem``) needs nothing checkpointed
    although its linear rows say otherwise: every stage fits the budget point by point exactly
    (without the rebuilt layer the rows count at every backward), and its host rows fit."""
    if not (problem.need > 0).any() or (problem.host is not None and not problem.host.fits(
            np.zeros(len(problem.col_var)))):
        return False
    limit = cost.memory_budget_bytes + slack_bytes
    for s, points in problem.stage_points.items():
        for view, pts in problem.view_points.get(s) or [(plan, points)]:
            if stage_peak_bytes(view, cost, problem.dp_rank, s, {}, checkpoint_levels={}, points=pts) > limit:
                return False
    return True
