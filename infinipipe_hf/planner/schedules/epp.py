"""``epp``: elastic pipeline parallelism -- elastic units, grouped pipelines, adaptive checkpointing.

Knobs: the slice count ``K`` of the longest sequence and, when every sequence is short, a unit
token floor (:mod:`.grids`).  Every setting is ranked by the closed-form estimate
(:mod:`.estimate`) and only the best few are planned in full (units, grouping, checkpointing),
because a full plan costs far more than an estimate.  Candidates are compared with the greedy
checkpoint solve on whole layers; the winner alone gets the finer levels and the LP/MILP
(:mod:`infinipipe_hf.planner.search.finish`).  Warm-up on stage ``r``: ``(pp - 1 - r) + (N - 1)``
forwards, ``N`` the slice count of the pipeline's first sequence.

Elastic SP rounds (``PipelineContext.sp_rounds``, at ``sp_degree > 1``): the same knob settings
are ranked again with short sequences regrouped onto SP sub-groups in rounds
(:mod:`infinipipe_hf.planner.batch.sub_groups`, :mod:`.round_pipeline`), and the best few of those
are planned after the whole-group candidates, so the search with rounds contains the search
without them and keeps whichever plan simulates faster.

Near the budget: the estimate plans into 95% of the memory budget, so in each family the setting
that ranks first when estimated up to the whole budget (among those the margin alone rules out,
and, with rounds, the floors of a few round counts as FlexSP runs short sequences: 1-8 and the
fewest the rank's memory cap allows) is planned too, as a family of its own (:mod:`.epp_ranking`, which ranks every setting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.actions import epp_warmup, replica_actions
from infinipipe_hf.planner.pipeline.grids import (
    MIN_SLICE_TOKENS,
)
from infinipipe_hf.planner.schedules.base import Candidate, Knobs, SearchState
from infinipipe_hf.planner.schedules.epp_ranking import EXACT_CANDIDATES, families, host_ordered, plannable
from infinipipe_hf.planner.schedules.epp_units import epp_units
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext, PipelineSchedule
from infinipipe_hf.planner.search.whole_units import wanted as whole_units_wanted
from infinipipe_hf.planner.simulate.simulator import simulate


@dataclass(frozen=True)
class EPPKnobs(Knobs):
    num_slices: int
    estimate_s: float
    always_planned: bool = False
    """Planned whatever the search has found (the unsliced candidate, see ``ranked_settings``)."""
    unit_token_floor: int | None = None
    sp_rounds: bool = False
    """Short sequences on SP sub-groups in rounds (:mod:`infinipipe_hf.planner.batch.sub_groups`)."""
    near_budget: bool = False
    """Planned because it ranks first when estimated up to the whole budget (:mod:`.epp_ranking`): its own
    family, so its plan is solved finely beside the best estimates' finalists, not instead of one."""
    adopted: str | None = None
    """The non-pipeline alternative whose rounds these units are (``adopt_rounds_of``): a family of
    its own."""

    @property
    def family(self) -> str:
        if self.adopted:
            return f"adopted:{self.adopted}"
        return "near_budget" if self.near_budget else "sp_rounds" if self.sp_rounds else "whole_groups"

    def record(self) -> dict:
        d = {"num_slices": self.num_slices, "estimate_s": self.estimate_s}
        if self.always_planned:
            d["always_planned"] = True
        if self.unit_token_floor:
            d["unit_token_floor"] = self.unit_token_floor
        if self.sp_rounds:
            d["sp_rounds"] = True
        if self.near_budget:
            d["near_budget"] = True
        if self.adopted:
            d["adopted_rounds_of"] = self.adopted
        return d


class EPPSchedule(PipelineSchedule):
    name = "epp"
    one_tail_per_unit = True
    reference = True
    elastic_sp_rounds = True

    def checkpoint_policy(self, requested: str) -> str:
        return requested

    def warmup(self, dims: ParallelDims, units: Sequence[Unit], num_slices: int = 1) -> list[int]:
        first_seq = units[0].segments[0].seq
        return epp_warmup(dims, sum(1 for u in units if first_seq in u.seqs))

    def candidates(self, ctx: PipelineContext, state: SearchState) -> Iterator[Candidate]:
        for ranked, always, rounds, adopted in families(ctx):
            yield from self._planned(ctx, state, ranked, always, rounds, adopted)

    def _planned(self, ctx: PipelineContext, state: SearchState, ranked: list, always: dict[int, bool],
                 rounds: bool, adopted: str | None = None) -> Iterator[Candidate]:
        """The best few of ``ranked`` (``ranked_settings``), and those at the positions ``always`` (position ->
        whether it is the near-budget candidate)."""
        before = len(state.tried)
        fitted_only = host_ordered(ctx, ranked)  # candidates that do not fit cost little: not counted
        for i, (est, k, floor, staged) in enumerate(plannable(ctx, ranked)):
            knobs = EPPKnobs(k, est, i in always, floor, rounds, always.get(i, False), adopted)
            counted = sum(1 for t in state.tried[before:] if t.get("feasible") or not fitted_only)
            if state.best is not None and counted >= EXACT_CANDIDATES and not knobs.always_planned:
                return  # ranked by the estimate: later candidates rarely win and each costs a full plan
            yield Candidate(knobs, partial(self._search_plan, ctx, k, floor, staged))

    def leanest_plan(self, cost: CostModel, n: int, max_slices: int) -> Plan:
        k = min(max_slices, max(1, n // (MIN_SLICE_TOKENS * cost.dims.sp_degree)))
        staged = epp_units([n], [[0]], cost, k, None, None)
        return self.plan([n], [[0]], cost, k, None, staged, "full", 1.0)

    def candidates_bound(self, ctx: PipelineContext, below_s: float) -> float | None:
        """A lower bound of the step any plan this search may return simulates: the least over
        every candidate it may plan of the candidate's units simulated with no recompute (the
        finishing solve changes only checkpointing, and less recompute never lengthens a replay),
        leaving out a candidate under ``below_s`` that the search would find does not fit.
        Stops at the first that fits under ``below_s``; None where the search has a candidate of
        other units (whole sequences in tiles)."""
        if whole_units_wanted(ctx):
            return None
        least = math.inf
        for ranked, *_ in families(ctx):
            for _, k, floor, staged in plannable(ctx, ranked):  # what ``_planned`` may plan
                try:
                    plan = self.units_plan(ctx.lengths, ctx.replicas, ctx.cost, k, floor, staged)
                except ValueError:  # a knob value the search would record as infeasible
                    continue
                step = simulate(plan, ctx.cost, memory=False).step_time_s
                if step < below_s and not self._fits(ctx, k, floor, staged):
                    continue
                least = min(least, step)
                if least < below_s:
                    return least
        return least

    def _fits(self, ctx: PipelineContext, k: int, floor: int | None, staged) -> bool:
        """Whether the search's own plan of this candidate fits (``run_search``: built, not
        rejected, simulated within the budgets); the plan and its simulation are kept for the
        search (``_search_plan``, ``simulate``), which would build the same."""
        try:
            plan = self.plan(ctx.lengths, ctx.replicas, ctx.cost, k, floor, staged, ctx.policy, ctx.time_limit_s)
        except ValueError as exc:
            ctx.memo.setdefault("built", {})[id(staged)] = exc
            return False
        sim = simulate(plan, ctx.cost)
        ctx.memo.setdefault("built", {})[id(staged)] = plan
        ctx.memo.setdefault("simulated", {})[id(plan)] = (plan, sim)
        return self.reject(plan, EPPKnobs(k, math.inf, unit_token_floor=floor), ctx) is None and sim.feasible

    def _search_plan(self, ctx: PipelineContext, k: int, floor: int | None, staged) -> Plan:
        """The candidate's plan (``plan``), or the one ``_fits`` built (or its error) for it."""
        built = ctx.memo.get("built", {}).pop(id(staged), None)
        if isinstance(built, ValueError):
            raise built
        if built is not None:
            return built
        return self.plan(ctx.lengths, ctx.replicas, ctx.cost, k, floor, staged, ctx.policy, ctx.time_limit_s)

    def simulate(self, plan: Plan, ctx: PipelineContext):
        """The plan's simulation, or the one ``_fits`` ran for it."""
        kept = ctx.memo.get("simulated", {}).pop(id(plan), None)
        return kept[1] if kept is not None and kept[0] is plan else super().simulate(plan, ctx)

    def plan(self, lengths, replicas, cost, k, floor, staged, policy, time_limit) -> Plan:
        """The plan of the staged units (``epp_units``), checkpointed under ``policy``."""
        plan = self.units_plan(lengths, replicas, cost, k, floor, staged)
        # Candidates are compared with the greedy on whole layers and diagonal-shared counts: the
        # cheapest solve, and a fair ranking since every candidate gets the same.
        sol = solve_checkpointing(plan, cost, policy="greedy" if policy == "adaptive" else policy,
                                  time_limit_s=time_limit, sharing="diagonal", verify=False)
        if not sol.feasible:
            raise ValueError(sol.message or "no checkpointing fits the memory budget")
        plan.checkpoint_layers = sol.checkpoint_layers
        plan.checkpoint_levels = sol.checkpoint_levels
        plan.info["checkpoint_method"] = sol.method
        plan.info["recompute_time_s"] = sol.recompute_time_s
        return plan

    def units_plan(self, lengths, replicas, cost, k, floor, staged) -> Plan:
        """The plan of the staged units (``epp_units``) with nothing checkpointed yet."""
        units: list[Unit] = []
        actions = {}
        info = {"num_slices": k, "token_budget": [], "balance": []}
        if floor:
            info["unit_token_floor"] = floor
        sp_groups, rounds = {}, []
        for dp_rank, st in enumerate(staged):
            if st.res is None:
                actions[dp_rank] = [[] for _ in range(cost.dims.pp_degree)]
                continue
            info["token_budget"].append(st.res.token_budget)
            info["balance"].append(round(st.res.balance(), 4))
            warm = partial(self.warmup, cost.dims)
            if st.items is None:
                part_units, actions[dp_rank] = replica_actions(lengths, cost, st.pipelines, dp_rank, warm)
                rounds.extend([u.id] for u in part_units)  # each unit its own round, on the whole group
            else:
                part_units, actions[dp_rank] = st.items.actions(lengths, cost, st.pipelines, dp_rank, warm)
                sp_groups.update(st.items.rounded.sp_groups)
                rounds.extend(st.items.rounded.rounds)
            units.extend(part_units)
        plan = Plan(self.name, cost.dims.pp_degree, len(replicas), list(lengths), units, actions, {},
                    list(cost.layers_per_stage), info, cost.dims.sp_degree, cost.dims.shard)
        if sp_groups:
            _add_rounds(plan, sp_groups, rounds)
        return plan


def _add_rounds(plan: Plan, sp_groups: dict, rounds: list[list[int]]) -> None:
    """Give ``plan`` its SP sub-groups and rounds, and say in its info what the rounds look like."""
    plan.sp_groups = dict(sorted(sp_groups.items()))
    plan.rounds = [list(r) for r in rounds]
    sizes: dict[int, int] = {}
    for members in rounds:
        for u in members:
            g = plan.sub_group(u).size
            sizes[g] = sizes.get(g, 0) + 1
    plan.info["sp_rounds"] = {"rounds": len(rounds), "units_per_group_size": {str(g): n for g, n in sorted(sizes.items())},
                              "single_gpu_units": sizes.get(1, 0),
                              "mixed_rounds": sum(1 for r in rounds if len(r) > 1)}
