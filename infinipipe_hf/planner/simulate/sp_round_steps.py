"""Replaying a plan with SP rounds: a round's units run side by side, each on its own sub-group.

The replay (:mod:`.replay`, or a cost model's replica replay) runs one action at a time per stage, so a
stage's round is replayed as one *step*: the round's forwards (or backwards) on that stage,
consecutive in its action list, become one action named after the round's first unit, lasting as
long as its slowest unit (with ``shard="sp"`` FSDP2 gathers every layer over the whole SP group,
so the sub-groups advance layer by layer together; without sharding they run independently and
the round waits for its slowest anyway, the step's next round needing every rank), and its
transfer as long as its largest unit's (every SP rank sends its own shard to the same rank of the
next stage).  After the replay every unit gets its own event: from its step's start for its own
duration (stretched like the step on shared cores).  Busy time counts each unit for the share of
the stage's ranks it holds, and memory is the busiest rank's (the rank views of
:mod:`infinipipe_hf.ir.rank_views`, whose actions line up one to one with the steps).
"""
from __future__ import annotations

from infinipipe_hf.ir.actions import Action, like
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import collapse_rounds, rank_classes, rank_view, round_of


class RoundSteps:
    """The steps of every stage of every replica, and what each step stands for (module docstring)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        rounds = round_of(plan)
        self.members = {plan.rounds[r][0]: list(plan.rounds[r]) for r in range(len(plan.rounds))}
        """Round's first unit -> the round's units."""
        self.first = {u: plan.rounds[r][0] for u, r in rounds.items()}
        self.steps = {r: [collapse_rounds(acts, rounds) for acts in per_stage] for r, per_stage in plan.actions.items()}
        self.lists = {r: [[like(step[0], self.first.get(step[0].unit, step[0].unit)) for step in stage]
                          for stage in per_stage] for r, per_stage in self.steps.items()}
        """The replayed lists: one action per step, named after its round's first unit."""
        self.views = [rank_view(plan, rank) for rank in rank_classes(plan)]
        self.share = {u: plan.sub_group(u).size / plan.sp_degree for u in plan.unit_by_id}
        """Share of a stage's SP ranks each unit runs on."""
        self._member_actions: dict[tuple[int, bool], list[Action]] = {}

    def units(self, uid: int) -> list[int]:
        """The units a replayed action stands for (the round of ``uid``)."""
        return self.members.get(self.first.get(uid, uid), [uid])

    def member_actions(self, a: Action) -> list[Action]:
        """The actions of the units a replayed action stands for (built once per round and kind)."""
        key = (a.unit, a.is_forward)
        got = self._member_actions.get(key)
        if got is None:
            got = self._member_actions[key] = [like(a, u) for u in self.units(a.unit)]
        return got

    def step_duration(self, unit_duration, stage: int, a: Action) -> float:
        return max(unit_duration(stage, m) for m in self.member_actions(a))

    def step_transfer(self, unit_transfer, a: Action) -> float:
        return max(unit_transfer(m) for m in self.member_actions(a))

    def unit_events(self, r: int, s: int, i: int, start: float, end: float, unit_duration):
        """``(action, start, end, share)`` of every unit of step ``i`` of stage ``s``, replica ``r``."""
        step = self.steps[r][s][i]
        durations = [unit_duration(s, a) for a in step]
        stretch = (end - start) / max(durations) if max(durations) > 0 else 0.0
        return [(a, start, start + d * stretch, self.share[a.unit]) for a, d in zip(step, durations)]
