"""Host bytes of one stage at each of its actions, and the peak: the host tier's memory timeline.

A stage's host bytes at an action are its checkpoint-independent part (model states kept on the
host, an offloaded KV store: ``StageTimeline.host_base``) plus what the host-level layers of every
live unit keep (forwarded on the stage, backward not finished), ``cost.host.unit_offload_bytes``.  The same live intervals as the device timeline
(:mod:`.memory_walk`), so every point is one linear row of the checkpoint solver (:mod:`.host_rows`).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from infinipipe_hf.ir.levels import HOST_LEVELS
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import has_sub_groups, rank_classes, rank_view
from infinipipe_hf.planner.checkpointing.memory_walk import LevelCounts, StageTimeline, stage_timeline
from infinipipe_hf.planner.cost.model import CostModel


def offloaded_bytes(cost: CostModel, stage: int, segments, counts: Mapping[str, int] | None) -> float:
    """Host bytes of a unit's offloaded layers on the stage (``counts``: its level counts)."""
    counts = counts or {}
    return cost.host.unit_offload_bytes(stage, segments, counts) if any(counts.get(lv) for lv in HOST_LEVELS) else 0.0


def host_point_values(tl: StageTimeline, cost: CostModel, stage: int,
                      checkpoint_levels: LevelCounts | None = None) -> np.ndarray:
    """Host bytes at every action of the timeline's stage under ``checkpoint_levels``."""
    n = len(tl.actions)
    base = tl.host_base if tl.host_base is not None else np.zeros(n)
    levels = checkpoint_levels or {}
    held = np.array([offloaded_bytes(tl.slot_costs.get(k, cost), stage, tl.segments[k], levels.get(u))
                     for k, u in enumerate(tl.units.tolist())], dtype=float)
    if n == 0 or not held.any():
        return np.asarray(base, dtype=float)
    if tl.regular:
        delta = np.zeros(2 * n)
        delta[2 * tl.fpos] = held
        delta[2 * tl.bpos + 1] = -held
        return base + np.cumsum(delta)[0::2]
    values, live, total = np.empty(n), set(), 0.0
    for j, (k, fw) in enumerate(zip(tl.slot.tolist(), tl.forward.tolist())):
        if k not in live:
            live.add(k)
            total += held[k]
        values[j] = base[j] + total
        if not fw:
            live.discard(k)
            total -= held[k]
    return values


def stage_host_peak_bytes(plan: Plan, cost: CostModel, dp_rank: int, stage: int,
                          checkpoint_levels: LevelCounts | None = None) -> float:
    """Peak host bytes of the stage on the replica (the plan's ``checkpoint_levels`` unless given;
    with SP rounds, its busiest SP rank's)."""
    levels = plan.checkpoint_levels.get(stage, {}) if checkpoint_levels is None else checkpoint_levels
    views = [rank_view(plan, r) for r in rank_classes(plan)] if has_sub_groups(plan) else [plan]
    cache: dict = {}
    peak = 0.0
    for view in views:
        tl = stage_timeline(view, cost, dp_rank, stage, cache if len(views) > 1 else None)
        values = host_point_values(tl, cost, stage, levels)
        peak = max(peak, float(values.max()) if len(values) else cost.host.state_host_bytes(stage))
    return peak


def host_peak_bytes_per_stage(plan: Plan, cost: CostModel) -> list[float]:
    """Peak host bytes of every stage, the max over DP replicas."""
    return [max((stage_host_peak_bytes(plan, cost, r, s) for r in sorted(plan.actions)), default=0.0)
            for s in range(plan.pp_degree)]
