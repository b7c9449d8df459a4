"""The validator's checks of SP sub-groups and rounds (:mod:`infinipipe_hf.ir.sp_rounds`).

What the runtime relies on when a plan runs units on parts of a stage's SP group:
- rounds only at ``sp_degree > 1``, and every round's sub-groups (aligned, powers of two) cover
  the stage's SP ranks exactly once (:func:`~infinipipe_hf.ir.sp_rounds.check_rounds`);
- all slices of a sequence on the same sub-group (its K/V stays on the ranks that made it);
- on every stage a round's forwards are consecutive, and so are its backwards;
- the units of a round share one checkpoint mix per stage (they run layer by layer together).

Each check returns ``None`` or ``(problem, dp_rank, marks)`` for the validator to report with
its grid (``marks``: (stage, action index) pairs to flag).
"""
from __future__ import annotations

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import collapse_rounds, round_of

Problem = tuple[str, int | None, list[tuple[int, int]]] | None


def rounds_structure(plan: Plan) -> Problem:
    """Rounds at ``sp_degree > 1`` only, covering every unit and every SP rank."""
    if not plan.rounds and not plan.sp_groups:
        return None
    if plan.sp_degree == 1:
        return (f"the plan has SP rounds or sub-groups but sp_degree=1 gives a stage one rank; rounds "
                f"need sp_degree >= 2 (drop 'rounds' and 'sp_groups', or plan with sp_degree >= 2)", None, [])
    try:
        plan.check_rounds()
    except ValueError as exc:
        return (f"SP rounds: {exc}", None, [])
    return None


def one_group_per_sequence(plan: Plan) -> Problem:
    """All units holding a sequence run on the same SP sub-group."""
    first: dict[int, tuple[int, object]] = {}
    for u in plan.units:
        g = plan.sub_group(u.id)
        for s in u.segments:
            uid, other = first.setdefault(s.seq, (u.id, g))
            if other != g:
                return (f"sequence {s.seq} runs on SP sub-group (offset {other.offset}, size {other.size}) in unit "
                        f"{uid} and on (offset {g.offset}, size {g.size}) in unit {u.id}; a sequence's slices carry "
                        f"K/V on the ranks that ran them, so keep all of them on one sub-group", u.dp_rank, [])
    return None


def contiguous_rounds(plan: Plan, r: int) -> Problem:
    """On every stage of replica ``r``, a round's forwards are consecutive and so are its backwards."""
    rounds = round_of(plan)
    for s, acts in enumerate(plan.actions[r]):
        seen: dict[tuple[str, int], int] = {}
        at = 0
        for step in collapse_rounds(acts, rounds):
            key = (step[0].kind, rounds.get(step[0].unit, -1 - step[0].unit))
            if key in seen:
                return (f"stage {s} of dp replica {r} splits the {'forwards' if key[0] == 'F' else 'backwards'} of "
                        f"round {key[1]} ({plan.rounds[key[1]]}) around other actions; a round's units run side by "
                        f"side, so its forwards (and its backwards) must be consecutive", r, [(s, seen[key]), (s, at)])
            seen[key] = at
            at += len(step)
    return None


def one_mix_per_round(plan: Plan) -> Problem:
    """The units of a round have the same checkpoint mix on every stage."""
    for s in range(plan.pp_degree):
        for k, members in enumerate(plan.rounds):
            mixes = {u: plan.checkpoint_mix(s, u) for u in members}
            if len(set(mixes.values())) > 1:
                u = next(iter(plan.unit_by_id[m] for m in members if m in plan.unit_by_id), None)
                return (f"stage {s} checkpoints the units of round {k} differently "
                        f"({', '.join(f'unit {m}: {mix}' for m, mix in mixes.items())}); a round's units run layer "
                        f"by layer together and take one checkpoint mix per stage", u.dp_rank if u else None, [])
    return None
