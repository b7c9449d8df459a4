"""A plan with SP rounds as its ranks and its rounds see it (:mod:`infinipipe_hf.ir.sp_rounds`).

With sub-groups, the SP ranks of a stage no longer all run every unit: SP rank ``i`` runs, in each
round, the one unit whose sub-group holds ``i``.  Its memory therefore follows its own units only,
and a stage's round runs its units side by side.  Three views answer that from the plan alone:

- :func:`round_of`: unit id -> index of its round in ``plan.rounds``;
- :func:`rank_classes` / :func:`rank_view`: the distinct SP ranks (ranks that run the same units
  in every round behave alike; one representative each) and the plan restricted to one rank's
  units -- an ordinary plan whose stage lists hold one forward and one backward per round, so
  every memory and checkpoint routine applies to it unchanged;
- :func:`collapse_rounds`: a stage's action list with each round's consecutive forwards (or
  backwards) as one step, the form the simulator replays.

A plan without sub-groups has one class (rank 0) whose view is the plan itself.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan


def has_sub_groups(plan: Plan) -> bool:
    """The plan runs rounds in which some unit has part of its stage's SP ranks, so its ranks
    differ (False for a rank view: its rounds are dropped, see :func:`rank_view`)."""
    return bool(plan.rounds) and any(g.size != plan.sp_degree for g in plan.sp_groups.values())


def round_of(plan: Plan) -> dict[int, int]:
    """Unit id -> its round's index in ``plan.rounds`` (empty when the plan has no rounds)."""
    return {u: r for r, members in enumerate(plan.rounds) for u in members}


def rank_classes(plan: Plan) -> list[int]:
    """One SP rank per class of ranks that run the same units (``[0]`` without sub-groups)."""
    if not has_sub_groups(plan):
        return [0]
    seen: dict[tuple[int, ...], int] = {}
    groups = sorted(plan.sp_groups.items())
    for rank in range(plan.sp_degree):
        key = tuple(u for u, g in groups if g.contains(rank))
        seen.setdefault(key, rank)
    return sorted(seen.values())


def rank_view(plan: Plan, sp_rank: int) -> Plan:
    """``plan`` with every stage's actions restricted to the units SP rank ``sp_rank`` runs (the
    plan itself when it has no sub-groups).  On one rank a round is one unit, so the view has no
    rounds; it keeps ``sp_groups``, which say what each of its units costs."""
    if not has_sub_groups(plan):
        return plan
    runs = {u.id for u in plan.units if plan.runs_on(u.id, sp_rank)}
    actions = {r: [[a for a in acts if a.unit in runs] for acts in per_stage] for r, per_stage in plan.actions.items()}
    return replace(plan, actions=actions, rounds=[])


def collapse_rounds(actions: Sequence[Action], rounds_of: Mapping[int, int]) -> list[list[Action]]:
    """``actions`` grouped into steps: a round's consecutive forwards (or backwards) form one
    step; a unit in no round is a step alone."""
    steps: list[list[Action]] = []
    last: tuple[str, int] | None = None
    for a in actions:
        r = rounds_of.get(a.unit)
        key = (a.kind, r) if r is not None else None
        if key is not None and key == last:
            steps[-1].append(a)
        else:
            steps.append([a])
        last = key
    return steps
