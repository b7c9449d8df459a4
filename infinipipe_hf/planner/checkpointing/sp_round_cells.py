"""The checkpoint problem of a plan with SP rounds: one variable per (stage, round), per-rank rows.

A round's units run side by side on disjoint sub-groups and take one checkpoint mix per stage
(the runtime's contract), so they share their variables; each distinct SP rank constrains the
units it runs (its rank view, :mod:`infinipipe_hf.ir.rank_views`), priced with its sub-group's
cost; and a checkpointed layer costs the round the replay of its slowest unit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import has_sub_groups
from infinipipe_hf.planner.cost.model import CostModel, unit_cost_map


@dataclass
class RoundCells:
    """What a plan with SP rounds changes in its problem (empty for a plan without)."""

    first: dict[int, int] = field(default_factory=dict)
    """Unit id -> the first unit of its round: the round's units share one variable per stage."""
    costs: dict[int, CostModel] = field(default_factory=dict)
    """Unit id -> the cost of its SP sub-group (:func:`unit_cost_map`)."""

    @staticmethod
    def of(plan: Plan, cost: CostModel) -> "RoundCells":
        if not has_sub_groups(plan):
            return RoundCells()
        return RoundCells({u: members[0] for members in plan.rounds for u in members}, unit_cost_map(plan, cost))


def slowest_member_pays(stages: list[int], units: list[int], rounds: RoundCells, col_redo: np.ndarray) -> None:
    """A round's units run side by side with one checkpoint mix, so recomputing a layer costs the
    round its slowest unit's replay: that unit's columns keep their seconds, the others' become 0."""
    slowest: dict[tuple[int, int], int] = {}
    for i, (p, u) in enumerate(zip(stages, units)):
        key = (p, rounds.first.get(u, u))
        j = slowest.get(key)
        if j is None or col_redo[i].sum() > col_redo[j].sum():
            slowest[key] = i
    keep = np.zeros(len(stages), dtype=bool)
    keep[list(slowest.values())] = True
    col_redo[~keep] = 0.0


def round_recompute_seconds(plan: Plan, cost: CostModel, shapes: dict, ck: dict[int, dict[int, int]],
                            levels: dict[int, dict[int, dict[str, int]]]) -> float:
    """Recompute seconds of a step with SP rounds: per stage and round, its slowest unit's."""
    costs = unit_cost_map(plan, cost)
    total = 0.0
    for s in range(plan.pp_degree):
        per, finer = ck.get(s, {}), levels.get(s, {})
        for members in plan.rounds:
            worst = 0.0
            for u in members:
                c = costs.get(u, cost)
                t = c.recompute_time(s, shapes[u], per.get(u, 0)) if per.get(u, 0) else 0.0
                if finer.get(u):
                    t += c.levels.finer_recompute_s(shapes[u], CheckpointMix.of(0, finer[u]))
                worst = max(worst, t)
            total += worst
    return total
