"""Rounds inside a stage, on the runtime's side: which actions an SP rank runs, and what the
runtime checks beyond the planner's validator.

A plan with SP sub-groups (``ir.rounds``) gives each unit the aligned sub-group of its stage's SP
ranks that runs it; a rank runs only the actions of units whose sub-group holds it
(``rank_actions``).  Because SP rank ``i`` of stage ``s`` talks only to SP rank ``i`` of stage
``s + 1`` and both drop the same units, every link still sees matching sends and receives, and
dropping whole units from a deadlock-free schedule leaves it deadlock-free.

The validator, which the engine runs on every plan before any communication, refuses rounds that
do not partition the SP ranks, a sequence whose slices run on two sub-groups (its context K/V
lives head-sharded on the ranks that ran its earlier slices), a round whose forwards (or
backwards) are not consecutive on a stage, and a round whose units checkpoint differently (with
``shard="sp"`` every SP rank gathers each layer's states per unit, so a round's units advance
layer by layer together).  ``check_runnable`` adds what only the engine knows or the validator
does not look at: the engine's ``sp_degree``, and a round held by one DP replica.
"""
from __future__ import annotations

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims


def rank_actions(plan: Plan, dp_rank: int, stage_index: int, sp_rank: int) -> list[Action]:
    """The actions of a stage that SP rank ``sp_rank`` runs (all of them without sub-groups)."""
    actions = plan.stage_actions(dp_rank, stage_index)
    if not plan.sp_groups:
        return list(actions)
    return [a for a in actions if plan.runs_on(a.unit, sp_rank)]


def check_runnable(plan: Plan, dims: ParallelDims) -> None:
    """``ValueError`` when ``plan``'s sub-groups or rounds cannot run on an engine of layout ``dims``."""
    if not plan.sp_groups and not plan.rounds:
        return
    sp_degree = dims.sp_degree
    if plan.sp_degree != sp_degree or sp_degree < 2:
        raise ValueError(f"the plan has SP sub-groups or rounds for sp_degree={plan.sp_degree} but the "
                         f"engine runs sp_degree={sp_degree}; rounds need sp_degree >= 2 and a plan made "
                         f"with the engine's sp_degree")
    try:
        plan.check_rounds()
    except ValueError as exc:
        raise ValueError(f"the plan's rounds cannot run: {exc}") from exc
    for r, members in enumerate(plan.round_units):
        replicas = sorted({plan.unit_by_id[u].dp_rank for u in members})
        if len(replicas) > 1:
            raise ValueError(f"round {r} (units {list(members)}) mixes DP replicas {replicas}; a round is "
                             f"the SP ranks of one replica's stages")
