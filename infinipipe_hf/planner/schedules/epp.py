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
fewest the rank's memory cap allows) is planned too, as a family of its own (``_ordered``).
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
from infinipipe_hf.planner.cost.activations import largest_fitting
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.actions import epp_warmup, replica_actions
from infinipipe_hf.planner.pipeline.grids import (
    MIN_SLICE_TOKENS,
    round_count_floors,
    slice_count_candidates,
    token_floor_candidates,
)
from infinipipe_hf.planner.schedules.base import Candidate, Knobs, SearchState
from infinipipe_hf.planner.schedules.epp_units import epp_units, margin_estimate
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext, PipelineSchedule
from infinipipe_hf.planner.search.whole_units import wanted as whole_units_wanted
from infinipipe_hf.planner.simulate.simulator import simulate

EXACT_CANDIDATES = 3
"""Knob settings planned and simulated exactly, best estimates first."""
MAX_EXACT_CANDIDATES = 8
"""When the best estimates do not fit, a few more are tried."""
ROUND_CANDIDATES = 4
"""Whole-group settings, best estimates first, staged again with SP rounds."""
ROUND_TOKEN_FLOORS = (6144, 10240, 12288)
"""Unit token floors per GPU also tried with SP rounds (next to the grid's 4K, 8K and 16K): a
round's tokens per rank trade FSDP gathers and kernel overheads against recompute, and the
optimum falls between the grid's points."""


@dataclass(frozen=True)
class EPPKnobs(Knobs):
    num_slices: int
    estimate_s: float
    always_planned: bool = False
    """Planned whatever the search has found (the unsliced candidate, see ``_ranked``)."""
    unit_token_floor: int | None = None
    sp_rounds: bool = False
    """Short sequences on SP sub-groups in rounds (:mod:`infinipipe_hf.planner.batch.sub_groups`)."""
    near_budget: bool = False
    """Planned because it ranks first when estimated up to the whole budget (``_ordered``): its own
    family, so its plan is solved finely beside the best estimates' finalists, not instead of one."""

    @property
    def family(self) -> str:
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
        for ranked, always, rounds in _families(ctx):
            yield from self._planned(ctx, state, ranked, always, rounds)

    def _planned(self, ctx: PipelineContext, state: SearchState, ranked: list, always: dict[int, bool],
                 rounds: bool) -> Iterator[Candidate]:
        """The best few of ``ranked`` (``_ranked``), and those at the positions ``always`` (position ->
        whether it is the near-budget candidate)."""
        before = len(state.tried)
        for i, (est, k, floor, staged) in enumerate(ranked[:MAX_EXACT_CANDIDATES]):
            knobs = EPPKnobs(k, est, i in always, floor, rounds, always.get(i, False))
            if state.best is not None and len(state.tried) - before >= EXACT_CANDIDATES and not knobs.always_planned:
                return  # ranked by the estimate: later candidates rarely win and each costs a full plan
            yield Candidate(knobs, partial(self.plan, ctx.lengths, ctx.replicas, ctx.cost, k, floor, staged,
                                           ctx.policy, ctx.time_limit_s))

    def leanest_plan(self, cost: CostModel, n: int, max_slices: int) -> Plan:
        k = min(max_slices, max(1, n // (MIN_SLICE_TOKENS * cost.dims.sp_degree)))
        staged = epp_units([n], [[0]], cost, k, None, None)
        return self.plan([n], [[0]], cost, k, None, staged, "full", 1.0)

    def candidates_bound(self, ctx: PipelineContext, below_s: float) -> float | None:
        """A lower bound of the step any plan this search may return simulates: the least over
        every candidate it may plan of the candidate's units simulated with no recompute (the
        finishing solve changes only checkpointing, and less recompute never lengthens a replay).
        Stops at the first candidate under ``below_s``; None where the search has a candidate of
        other units (whole sequences in tiles)."""
        if whole_units_wanted(ctx):
            return None
        least = math.inf
        for ranked, _, _ in _families(ctx):
            for _, k, floor, staged in ranked[:MAX_EXACT_CANDIDATES]:  # what ``_planned`` may plan
                try:
                    plan = self.units_plan(ctx.lengths, ctx.replicas, ctx.cost, k, floor, staged)
                except ValueError:  # a knob value the search would record as infeasible
                    continue
                least = min(least, simulate(plan, ctx.cost, memory=False).step_time_s)
                if least < below_s:
                    return least
        return least

    def plan(self, lengths, replicas, cost, k, floor, staged, policy, time_limit) -> Plan:
        """The plan of the staged units (``epp_units``), checkpointed under ``policy``."""
        plan = self.units_plan(lengths, replicas, cost, k, floor, staged)
        # Candidates are compared with the greedy on whole layers and diagonal-shared counts: the
        # cheapest solve, and a fair ranking since every candidate gets the same.
        sol = solve_checkpointing(plan, cost, policy="greedy" if policy == "adaptive" else policy,
                                  time_limit_s=time_limit, sharing="diagonal")
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


def _families(ctx: PipelineContext) -> Iterator[tuple[list, dict[int, bool], bool]]:
    """The search's families of knob settings in the order it plans them, as ``(ranked, always,
    sp_rounds)`` (``always``: positions planned whatever the search has found, and whether each is
    the near-budget candidate): on whole SP groups (:func:`_ranked`), then with SP rounds when the
    context has them."""
    yield (*_ranked(ctx), False)
    if ctx.sp_rounds:
        yield (*_ranked_with_rounds(ctx), True)


def _ranked(ctx: PipelineContext) -> tuple[list, dict[int, bool]]:
    """Every knob setting as ``(estimate, K, floor, staged)``, best estimate first, and the
    positions planned whatever the search has found (:func:`_ordered`; once per context)."""
    if "ranked" not in ctx.memo:
        ctx.memo["ranked"] = _rank(ctx)
    return ctx.memo["ranked"]


def _rank(ctx: PipelineContext) -> tuple[list, dict[int, bool]]:
    lengths, cost = ctx.lengths, ctx.cost
    ranked = []
    floors = token_floor_candidates(lengths, cost.dims) if ctx.max_tokens_per_unit is None else [None]
    for k in slice_count_candidates(lengths, ctx.num_slices, cost.dims):
        for floor in (floors if k == 1 else [None]):
            try:
                staged = epp_units(lengths, ctx.replicas, cost, k, ctx.max_tokens_per_unit, floor)
            except ValueError:
                continue
            ranked.append((max(st.estimate for st in staged), k, floor, staged))
    return _ordered(ranked, ctx)


def _ranked_with_rounds(ctx: PipelineContext) -> tuple[list, dict[int, bool]]:
    """:func:`_ranked` with SP rounds: the best ``ROUND_CANDIDATES`` whole-group settings, the
    unsliced one, the ``ROUND_TOKEN_FLOORS`` and the floors of a few round counts
    (:func:`~infinipipe_hf.planner.pipeline.grids.round_count_floors`), staged with rounds
    (settings where no replica forms a round are dropped: their whole-group candidate covers
    them); once per context."""
    if "rounds" not in ctx.memo:
        ctx.memo["rounds"] = _rank_with_rounds(ctx, _ranked(ctx)[0])
    return ctx.memo["rounds"]


def _rank_with_rounds(ctx: PipelineContext, whole: list) -> tuple[list, dict[int, bool]]:
    lengths, cost = ctx.lengths, ctx.cost
    settings = [(k, floor, staged) for est, k, floor, staged in whole if not math.isinf(est)][:ROUND_CANDIDATES]
    settings += [(k, f, st) for _, k, f, st in whole if (k, f) == (1, None) and (k, f, st) not in settings]
    seen = {(k, f) for _, k, f, _ in whole}
    near = []
    if ctx.max_tokens_per_unit is None and 1 in slice_count_candidates(lengths, ctx.num_slices, cost.dims):
        floors = [p * cost.dims.sp_degree for p in ROUND_TOKEN_FLOORS]
        settings += [(1, f, None) for f in floors if max(lengths) < f < sum(lengths) and (1, f) not in seen]
        seen |= {(k, f) for k, f, _ in settings}
        cap = one_rank_token_cap(cost, sum(lengths))
        near = [(1, f, None) for f in round_count_floors(lengths, ctx.replicas, cost.dims, cap)
                if (1, f) not in seen and (cap is None or f // (2 * cost.dims.sp_degree) <= cap)]
    ranked, near_budget = _staged_with_rounds(ctx, settings), _staged_with_rounds(ctx, near)
    return _ordered(ranked, ctx, near_budget)


def one_rank_token_cap(cost: CostModel, most: int) -> int | None:
    """The most tokens (up to ``most``) a single-GPU unit holds on every stage with every layer
    checkpointed; None with a host tier, where layer inputs may leave the device.  A round count's
    floor is worth staging where half its share of a rank fits (a packing that spills into more
    rounds than asked balances them into smaller units)."""
    if cost.host_budget_bytes > 0:
        return None
    one = cost.for_group(1).acts
    return largest_fitting(lambda tokens: all(
        one.static_bytes(s) + one.unit_peak_bytes(s, tokens, n) <= cost.memory_budget_bytes
        for s, n in enumerate(cost.layers_per_stage)), int(most))


def _staged_with_rounds(ctx: PipelineContext, settings: list) -> list:
    """``(estimate, K, floor, staged)`` of each setting staged with SP rounds where some replica
    forms a round."""
    ranked = []
    for k, floor, staged in settings:
        try:
            rounds = epp_units(ctx.lengths, ctx.replicas, ctx.cost, k, ctx.max_tokens_per_unit, floor, True, staged)
        except ValueError:
            continue
        if any(st.items is not None for st in rounds):
            ranked.append((max(st.estimate for st in rounds), k, floor, rounds))
    return ranked


def _ordered(ranked: list, ctx: PipelineContext, near_budget: Sequence = ()) -> tuple[list, dict[int, bool]]:
    """``ranked`` best estimate first, and the positions planned whatever the search has found:
    two candidates the estimate may misrank are moved up to them.

    - The unsliced candidate (whole sequences, as the packing baselines run), when the estimate
      puts it a few percent behind.
    - The candidate the estimate's safety margin alone rules out, or one of ``near_budget``, that
      ranks first when every candidate is estimated up to the whole budget
      (:func:`.margin_estimate`): a plan near the budget may still fit exactly.  ``near_budget``
      candidates (a few rounds of equal single-GPU units, as FlexSP runs short sequences) are
      planned only this way, so they never push the best estimates out of the search.
    """
    # Among candidates the estimate calls infeasible, more slices (less memory) go first.
    ranked.sort(key=lambda r: (r[0], -r[1] if math.isinf(r[0]) else r[1]))
    moved = []
    at = next((i for i, r in enumerate(ranked) if r[1] == 1 and r[2] is None), -1)
    if at >= EXACT_CANDIDATES and not math.isinf(ranked[at][0]):
        moved.append(ranked.pop(at))
    pool = [r for r in ranked[EXACT_CANDIDATES:] if math.isinf(r[0])] + list(near_budget)
    best = margin_estimate(ranked[0][3], ctx.cost, ctx.lengths) if ranked and pool else math.inf
    margins = (margin_estimate(r[3], ctx.cost, ctx.lengths) for r in pool)
    scored = [(m, i) for i, m in enumerate(margins) if m < best]
    if scored:
        chosen = pool[min(scored)[1]]
        ranked = [r for r in ranked if r is not chosen]
        moved.insert(0, chosen)
    start = min(EXACT_CANDIDATES, len(ranked))
    ranked[start:start] = moved
    return ranked, {start + i: bool(scored) and i == 0 for i in range(len(moved))}


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
