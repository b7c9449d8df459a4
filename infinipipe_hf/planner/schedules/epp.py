"""``epp``: elastic pipeline parallelism -- elastic units, grouped pipelines, adaptive checkpointing.

Knobs: the slice count ``K`` of the longest sequence and, when every sequence is short, a unit
token floor (:mod:`.grids`).  Every setting is ranked by the closed-form estimate
(:mod:`.estimate`) and only the best few are planned in full (units, grouping, checkpointing),
because a full plan costs far more than an estimate.  Candidates are compared with the greedy
checkpoint solve on whole layers; the winner alone gets the finer levels and the LP/MILP
(:mod:`infinipipe_hf.planner.search.finish`).  Warm-up on stage ``r``: ``(pp - 1 - r) + (N - 1)``
forwards, ``N`` the slice count of the pipeline's first sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.planner.batch.elastic import make_elastic_units
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.schedules.base import Candidate, Knobs, SearchState
from infinipipe_hf.planner.schedules.estimate import PipelineEstimator
from infinipipe_hf.planner.schedules.grids import MIN_SLICE_TOKENS, slice_count_candidates, token_floor_candidates
from infinipipe_hf.planner.schedules.grouping import (
    MAX_GROUPING_BLOCKS,
    blocks_by_slice_count,
    group_pipelines,
    merge_blocks,
)
from infinipipe_hf.planner.schedules.pipeline import epp_warmup, replica_actions
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext, PipelineSchedule

EXACT_CANDIDATES = 3
"""Knob settings planned and simulated exactly, best estimates first."""
MAX_EXACT_CANDIDATES = 8
"""When the best estimates do not fit, a few more are tried."""


@dataclass(frozen=True)
class EPPKnobs(Knobs):
    num_slices: int
    estimate_s: float
    always_planned: bool = False
    """Planned whatever the search has found (the unsliced candidate, see ``_ranked``)."""
    unit_token_floor: int | None = None

    def record(self) -> dict:
        d = {"num_slices": self.num_slices, "estimate_s": self.estimate_s}
        if self.always_planned:
            d["always_planned"] = True
        if self.unit_token_floor:
            d["unit_token_floor"] = self.unit_token_floor
        return d


class EPPSchedule(PipelineSchedule):
    name = "epp"
    one_tail_per_unit = True
    reference = True

    def checkpoint_policy(self, requested: str) -> str:
        return requested

    def warmup(self, pp_degree: int, units: Sequence[Unit], num_slices: int = 1) -> list[int]:
        first_seq = units[0].segments[0].seq
        return epp_warmup(pp_degree, sum(1 for u in units if first_seq in u.seqs))

    def candidates(self, ctx: PipelineContext, state: SearchState) -> Iterator[Candidate]:
        ranked, moved = _ranked(ctx)
        for i, (est, k, floor, staged) in enumerate(ranked[:MAX_EXACT_CANDIDATES]):
            knobs = EPPKnobs(k, est, moved and i == EXACT_CANDIDATES, floor)
            if state.best is not None and len(state.tried) >= EXACT_CANDIDATES and not knobs.always_planned:
                return  # ranked by the estimate: later candidates rarely win and each costs a full plan
            yield Candidate(knobs, partial(self.plan, ctx.lengths, ctx.replicas, ctx.cost, k, floor, staged,
                                           ctx.policy, ctx.time_limit_s))

    def leanest_plan(self, cost: CostModel, n: int, max_slices: int) -> Plan:
        k = min(max_slices, max(1, n // (MIN_SLICE_TOKENS * cost.sp_degree)))
        staged = epp_units([n], [[0]], cost, k, None, None)
        return self.plan([n], [[0]], cost, k, None, staged, "full", 1.0)

    def plan(self, lengths, replicas, cost, k, floor, staged, policy, time_limit) -> Plan:
        """The plan of the staged units (``epp_units``), checkpointed under ``policy``."""
        units: list[Unit] = []
        actions = {}
        info = {"num_slices": k, "token_budget": [], "balance": []}
        if floor:
            info["unit_token_floor"] = floor
        for dp_rank, (res, pipelines, _) in enumerate(staged):
            if res is None:
                actions[dp_rank] = [[] for _ in range(cost.pp_degree)]
                continue
            info["token_budget"].append(res.token_budget)
            info["balance"].append(round(res.balance(), 4))
            part_units, actions[dp_rank] = replica_actions(lengths, cost, pipelines, dp_rank,
                                                           partial(self.warmup, cost.pp_degree))
            units.extend(part_units)
        plan = Plan(self.name, cost.pp_degree, len(replicas), list(lengths), units, actions, {},
                    list(cost.layers_per_stage), info, cost.sp_degree, cost.shard)
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


def _ranked(ctx: PipelineContext) -> tuple[list, bool]:
    """Every knob setting as ``(estimate, K, floor, staged)``, best estimate first, and whether
    the unsliced candidate was moved up to be planned."""
    lengths, cost = ctx.lengths, ctx.cost
    ranked = []
    floors = token_floor_candidates(lengths, cost.sp_degree) if ctx.max_tokens_per_unit is None else [None]
    for k in slice_count_candidates(lengths, ctx.num_slices, cost.sp_degree):
        for floor in (floors if k == 1 else [None]):
            try:
                staged = epp_units(lengths, ctx.replicas, cost, k, ctx.max_tokens_per_unit, floor)
            except ValueError:
                continue
            ranked.append((max(est for _, _, est in staged), k, floor, staged))
    # Among candidates the estimate calls infeasible, more slices (less memory) go first.
    ranked.sort(key=lambda r: (r[0], -r[1] if math.isinf(r[0]) else r[1]))
    # The unsliced candidate (whole sequences, as the packing baselines run) is always planned:
    # the estimate can misrank it by a few percent.
    at = next((i for i, r in enumerate(ranked) if r[1] == 1 and r[2] is None), -1)
    moved = at >= EXACT_CANDIDATES and not math.isinf(ranked[at][0])
    if moved:
        ranked.insert(EXACT_CANDIDATES, ranked.pop(at))
    return ranked, moved


def epp_units(lengths, replicas, cost, k, max_tokens_per_unit, floor):
    """Per replica: (slicing result, pipelines of units, estimated time)."""
    staged = []
    next_id = 0
    for seqs in replicas:
        if not seqs:
            staged.append((None, [], 0.0))
            continue
        res = make_elastic_units(lengths, cost, k, seqs=seqs, max_tokens_per_unit=max_tokens_per_unit,
                                 first_unit_id=next_id, min_token_budget=floor)
        next_id += len(res.units)
        per_id = {u.id: u for u in res.units}
        blocks = blocks_by_slice_count(res.units, res.slice_counts)
        if len(blocks) > MAX_GROUPING_BLOCKS:
            blocks = merge_blocks(blocks, MAX_GROUPING_BLOCKS)
        estimator = PipelineEstimator(res.units, cost, lengths)
        groups = group_pipelines(blocks, estimator.time_of_ids)
        pipelines = [[per_id[i] for i in ids] for ids in groups]
        est = sum(estimator.time_of_ids(ids) for ids in groups)
        staged.append((res, pipelines, est))
    return staged
