"""The layout search's last step: no pick behind an alternative whose plan is an EPP plan.

FlexSP's, ZeRO-3 + Ulysses' and packed ring CP's plans (at cp 1) are EPP plans at pp 1 x sp =
world, dp 1, sharded over SP (:mod:`infinipipe_hf.planner.search.adopted`).  EPP's own search
may pack the same rounds a little differently; where such an alternative simulates faster than
the pick, those layouts are planned again with the alternative's rounds among their candidates
(``adopt_rounds_of``), a faster replan replaces the layout's outcome, and the pick is made again.
The recommendation then carries ``adopt_rounds_of`` in its settings, so the trainer (and the
replan command) plans every batch the same way.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Sequence

from infinipipe_hf.planner.layout_search.result import LayoutOutcome
from infinipipe_hf.planner.search.adopted import adoptable
from infinipipe_hf.planner.search.result import PlanResult


def ahead_of(best: LayoutOutcome | None, alternatives: Mapping[str, PlanResult]) -> tuple[str, ...]:
    """The alternatives whose plan is an EPP plan and simulates faster than ``best`` (beyond the
    tie-break's relative 1e-9)."""
    floor = best.tokens_per_s * (1 + 1e-9) if best is not None else 0.0
    return tuple(name for name, result in alternatives.items()
                 if result.feasible and result.simulation.tokens_per_s > floor and adoptable(result.plan))


def holding_layouts(outcomes: Sequence[LayoutOutcome], world_size: int) -> list[int]:
    """Indices of the outcomes whose layout holds the alternatives' plans: pp 1, dp 1, sp = world,
    sharded over SP (any state offload)."""
    return [i for i, o in enumerate(outcomes)
            if (o.layout.pp_degree, o.layout.dp_degree, o.layout.sp_degree) == (1, 1, world_size)
            and o.layout.shard.name == "sp" and not o.unfed_replicas]


def adopt_ahead(inputs, outcomes: list[LayoutOutcome], alternatives: Mapping[str, PlanResult], world_size: int,
                best: LayoutOutcome | None, plan_layout: Callable, pick: Callable) -> tuple[LayoutOutcome | None, tuple]:
    """Replan the layouts that hold the alternatives' plans with those ahead of ``best`` adopted
    (module docstring); ``outcomes`` is updated in place.  Returns the new pick and the adopted
    alternatives (empty when the pick is not an adopted replan)."""
    ahead = ahead_of(best, alternatives)
    if not ahead:
        return best, ()
    adopting = replace(inputs, plan_options={**inputs.plan_options, "adopt_rounds_of": ahead})
    replanned = set()
    for i in holding_layouts(outcomes, world_size):
        again = plan_layout(adopting, outcomes[i].layout)
        if again.feasible and (not outcomes[i].feasible or again.tokens_per_s > outcomes[i].tokens_per_s):
            again.search_time_s += outcomes[i].search_time_s
            outcomes[i] = again
            replanned.add(id(again))
    new = pick(outcomes)
    return new, ahead if new is not None and id(new) in replanned else ()
