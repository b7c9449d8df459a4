"""Candidate plans of each pipeline schedule, for :func:`~.api.plan_step` to simulate and pick from.

EPP's knobs are the slice count of the longest sequence and, when every sequence is short, a unit
token floor; its candidates are ranked by the closed-form estimate (:mod:`.estimate`) and only the
best few are planned in full, because a full plan (units, grouping, checkpointing) costs
0.1-0.3 s each on a 512-sequence batch.  The baselines' knobs (packing length, uniform slice
count) form a small grid planned exhaustively with the least uniform checkpointing that fits.
Each candidate is a ``(knobs, make_plan)`` pair: the knobs are recorded whether or not it fits.
"""
from __future__ import annotations

import math
from typing import Sequence

from infinipipe_hf.planner.batch.uniform import (make_packed_units, make_uniform_slices, packing_candidates,
    slicing_candidates)
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.schedules.estimate import PipelineEstimator
from infinipipe_hf.planner.schedules.grouping import group_pipelines
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.planner.schedules.pipeline import replica_actions
from infinipipe_hf.planner.batch.elastic import make_elastic_units
from infinipipe_hf.ir.units import Unit

DEFAULT_SLICE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MIN_SLICE_TOKENS = 256
"""Fewest tokens per GPU in a slice of the longest sequence searched (thinner slices run the GPU badly)."""
EXACT_CANDIDATES = 3  # EPP knob settings planned and simulated exactly, best estimates first
MAX_GROUPING_BLOCKS = 24
MAX_EXACT_CANDIDATES = 8  # when the best estimates do not fit, a few more are tried


# --- EPP -----------------------------------------------------------------------------------
def slice_count_candidates(lengths: Sequence[int], num_slices: Sequence[int] | None,
                            sp_degree: int = 1) -> list[int]:
    if num_slices:
        return sorted(set(int(k) for k in num_slices))
    longest = max(lengths)
    ks = [k for k in DEFAULT_SLICE_COUNTS if k == 1 or longest / k >= MIN_SLICE_TOKENS * sp_degree]
    return ks


def token_floor_candidates(lengths: Sequence[int], sp_degree: int = 1) -> list[int | None]:
    """Unit token floors tried next to the slice mesh: packing short sequences into units larger than
    the longest sequence's slice pays off when every sequence is short (few, efficient units).
    A stage of ``sp_degree`` GPUs runs a unit ``sp_degree`` times longer as efficiently."""
    longest = max(lengths)
    return [None] + [p * sp_degree for p in (4096, 8192, 16384) if longest < p * sp_degree < sum(lengths)]


def epp_candidates(lengths, replicas, cost, num_slices, max_tokens_per_unit, policy, time_limit):
    """EPP knobs ranked by the closed-form estimate; the best few are planned and simulated exactly."""
    ranked = []
    floors = token_floor_candidates(lengths, cost.sp_degree) if max_tokens_per_unit is None else [None]
    for k in slice_count_candidates(lengths, num_slices, cost.sp_degree):
        for floor in (floors if k == 1 else [None]):
            try:
                staged = epp_units(lengths, replicas, cost, k, max_tokens_per_unit, floor)
            except ValueError:
                continue
            ranked.append((max(est for _, _, est in staged), k, floor, staged))
    # Among candidates the estimate calls infeasible, more slices (less memory) go first.
    ranked.sort(key=lambda r: (r[0], -r[1] if math.isinf(r[0]) else r[1]))
    # The unsliced candidate (whole sequences, as the packing baselines run) is always planned: the
    # estimate misranks it by several percent (Llama-30B, 96K, sp 8: 3% over K=3, exact 3% under).
    at = next((i for i, r in enumerate(ranked) if r[1] == 1 and r[2] is None), -1)
    moved = at >= EXACT_CANDIDATES and not math.isinf(ranked[at][0])
    if moved:
        ranked.insert(EXACT_CANDIDATES, ranked.pop(at))
    for i, (est, k, floor, staged) in enumerate(ranked[:MAX_EXACT_CANDIDATES]):
        knobs = {"num_slices": k, "estimate_s": est, **({"always_planned": True} if moved and i == EXACT_CANDIDATES else {})}
        if floor:
            knobs["unit_token_floor"] = floor
        yield knobs, (lambda k=k, floor=floor, staged=staged:
                      epp_plan(lengths, replicas, cost, k, floor, staged, policy, time_limit))


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


def merge_blocks(blocks: list[list[int]], limit: int) -> list[list[int]]:
    """Merge neighbouring blocks (smallest first) until at most ``limit`` remain."""
    blocks = [list(b) for b in blocks]
    while len(blocks) > limit:
        i = min(range(len(blocks) - 1), key=lambda j: len(blocks[j]) + len(blocks[j + 1]))
        blocks[i:i + 2] = [blocks[i] + blocks[i + 1]]
    return blocks


def epp_plan(lengths, replicas, cost, k, floor, staged, policy, time_limit) -> Plan:
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
        part_units, actions[dp_rank] = replica_actions(lengths, cost, pipelines, dp_rank, "epp")
        units.extend(part_units)
    plan = Plan("epp", cost.pp_degree, len(replicas), list(lengths), units, actions, {},
                list(cost.layers_per_stage), info, cost.sp_degree, cost.shard)
    # Candidates are compared with the greedy on whole layers and diagonal-shared counts: the
    # cheapest solve (a few ms), and a fair ranking since every candidate gets the same.  The
    # winner alone gets the finer levels, its own counts per cell and the LP/MILP (plan_step).
    sol = solve_checkpointing(plan, cost, policy="greedy" if policy == "adaptive" else policy,
                              time_limit_s=time_limit, sharing="diagonal")
    if not sol.feasible:
        raise ValueError(sol.message or "no checkpointing fits the memory budget")
    plan.checkpoint_layers = sol.checkpoint_layers
    plan.checkpoint_levels = sol.checkpoint_levels
    plan.info["checkpoint_method"] = sol.method
    plan.info["recompute_time_s"] = sol.recompute_time_s
    return plan


def blocks_by_slice_count(units: Sequence[Unit], slice_counts: dict[int, int]) -> list[list[int]]:
    """Grouping blocks: one per slice chain of a long sequence, one per run of packed units.

    A chain never straddles two pipelines; separate blocks per chain let the grouping DP put a
    pipeline boundary between two long sequences (their K/V stores then never coexist).
    """
    blocks: list[list[int]] = []
    last_is_chain = False
    for u in units:
        count = max(slice_counts.get(s.seq, 1) for s in u.segments)
        continues_chain = any(s.start > 0 for s in u.segments)
        starts_chain = count > 1 and not continues_chain
        if not blocks or starts_chain or (count == 1 and last_is_chain):
            blocks.append([u.id])
            last_is_chain = starts_chain
        else:
            blocks[-1].append(u.id)
    return blocks


# --- baselines ------------------------------------------------------------------------------
def baseline_candidates(lengths, replicas, cost, schedule, policy, max_tokens_per_unit=None, num_slices=None):
    packs = packing_candidates(lengths, cost.sp_degree)
    if max_tokens_per_unit is not None:
        # The cap itself (or the longest sequence, which packing never cuts) as the tightest pack.
        packs = sorted(set(packs) | {max(max(lengths), int(max_tokens_per_unit))})
    slice_counts = [1]
    if schedule == "seq1f1b":  # uniform slice counts: the caller's (a static setting) or the grid
        slice_counts = (sorted(set(int(k) for k in num_slices)) if num_slices
                        else slicing_candidates(lengths, sp_degree=cost.sp_degree))
    for pack in packs:
        for k in slice_counts:
            knobs = {"pack_tokens": pack} if schedule != "seq1f1b" else {"pack_tokens": pack, "num_slices": k}
            yield knobs, (lambda pack=pack, k=k: baseline_plan(lengths, replicas, cost, schedule, pack, k, policy))


def baseline_plan(lengths, replicas, cost, schedule, pack, k, policy) -> Plan:
    units: list[Unit] = []
    actions = {}
    for dp_rank, seqs in enumerate(replicas):
        if not seqs:
            actions[dp_rank] = [[] for _ in range(cost.pp_degree)]
            continue
        if schedule == "seq1f1b":
            made = make_uniform_slices(lengths, cost, pack, k, seqs=seqs, first_unit_id=len(units))
        else:
            made = make_packed_units(lengths, cost, pack, seqs=seqs, first_unit_id=len(units))
        part_units, actions[dp_rank] = replica_actions(lengths, cost, [made], dp_rank, schedule, k)
        units.extend(part_units)
    info = {"pack_tokens": pack}
    if schedule == "seq1f1b":
        info["num_slices"] = k
    plan = Plan(schedule, cost.pp_degree, len(replicas), list(lengths), units, actions, {},
                list(cost.layers_per_stage), info, cost.sp_degree, cost.shard)
    sol = solve_checkpointing(plan, cost, policy=policy)
    if not sol.feasible:
        raise ValueError(sol.message or "no checkpointing fits the memory budget")
    plan.checkpoint_layers = sol.checkpoint_layers
    plan.info["checkpoint_method"] = sol.method
    if policy == "uniform":  # the one count (static settings over a run take the largest of a run)
        plan.info["uniform_layers"] = max((c for per in sol.checkpoint_layers.values() for c in per.values()), default=0)
    return plan
