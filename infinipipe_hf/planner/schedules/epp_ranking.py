"""EPP's knob settings ranked for its search: the slice count ``K`` of the longest sequence and,
when every sequence is short, a unit token floor (:mod:`infinipipe_hf.planner.pipeline.grids`),
each staged (units grouped into pipelines, :mod:`.epp_units`) and ranked by the closed-form
estimate; with elastic SP rounds the best few again on SP sub-groups; near the budget, candidates
the estimate's margin alone rules out (``_ordered``).  Which of them the search plans, and how many
(``plannable``), is decided here too, so its candidates' bound covers exactly what it may plan.
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence

from infinipipe_hf.planner.cost.activations import largest_fitting
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.pipeline.grids import round_count_floors, slice_count_candidates, token_floor_candidates
from infinipipe_hf.planner.schedules.epp_units import adopted_units, epp_units, margin_estimate
from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext

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


def families(ctx: PipelineContext) -> Iterator[tuple[list, dict[int, bool], bool, str | None]]:
    """The search's families of knob settings in the order it plans them, as ``(ranked, always,
    sp_rounds, adopted)`` (``always``: positions planned whatever the search has found, and whether
    each is the near-budget candidate; ``adopted``: the alternative whose rounds the family holds):
    on whole SP groups (:func:`ranked_settings`), then with SP rounds when the context has them,
    then each adopted alternative's rounds that are units of this layout (:func:`adopted_settings`)."""
    yield (*ranked_settings(ctx), False, None)
    if ctx.sp_rounds:
        yield (*ranked_with_rounds(ctx), True, None)
    for name, ranked in adopted_settings(ctx):
        yield ranked, {0: False}, True, name


def adopted_settings(ctx: PipelineContext) -> list[tuple[str, list]]:
    """Per adopted alternative (``ctx.adopted``) whose rounds are units of this layout, its one
    setting ``[(estimate, 1, None, staged)]``; once per context."""
    if "adopted" not in ctx.memo:
        got = []
        for name, rounds in ctx.adopted:
            staged = adopted_units(ctx.lengths, ctx.cost, rounds)
            if staged is not None:
                got.append((name, [(max(st.estimate for st in staged), 1, None, staged)]))
        ctx.memo["adopted"] = got
    return ctx.memo["adopted"]


def ranked_settings(ctx: PipelineContext) -> tuple[list, dict[int, bool]]:
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


def ranked_with_rounds(ctx: PipelineContext) -> tuple[list, dict[int, bool]]:
    """:func:`ranked_settings` with SP rounds: the best ``ROUND_CANDIDATES`` whole-group settings, the
    unsliced one, the ``ROUND_TOKEN_FLOORS`` and the floors of a few round counts
    (:func:`~infinipipe_hf.planner.pipeline.grids.round_count_floors`), staged with rounds
    (settings where no replica forms a round are dropped: their whole-group candidate covers
    them); once per context."""
    if "rounds" not in ctx.memo:
        ctx.memo["rounds"] = _rank_with_rounds(ctx, ranked_settings(ctx)[0])
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
    ranked = _by_estimate(ranked, ctx)
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


def _by_estimate(ranked: list, ctx: PipelineContext) -> list:
    """``ranked`` best estimate first.  Candidates the estimate calls infeasible on the device follow:
    more slices (less memory) first; with a host tier, which may take what the device cannot hold,
    the fastest with memory ignored first (fewer, larger units pay fewer per-unit terms), and
    ``plannable`` then plans past those that still do not fit."""
    fits = sorted((r for r in ranked if not math.isinf(r[0])), key=lambda r: (r[0], r[1]))
    rest = sorted((r for r in ranked if math.isinf(r[0])), key=lambda r: -r[1])
    if host_ordered(ctx, rest):
        free = [margin_estimate(r[3], ctx.cost, ctx.lengths, safety=math.inf) for r in rest]
        rest = [rest[i] for i in sorted(range(len(rest)), key=lambda i: (free[i], -rest[i][1]))]
    return fits + rest


def host_ordered(ctx: PipelineContext, ranked: list) -> bool:
    """Whether ``ranked`` holds candidates ordered for a host tier (``_by_estimate``)."""
    return ctx.cost.host_budget_bytes > 0 and any(math.isinf(r[0]) for r in ranked)


def plannable(ctx: PipelineContext, ranked: list) -> list:
    """The candidates of ``ranked`` the search may plan: the best ``MAX_EXACT_CANDIDATES``, or every
    one when a host tier orders them (the fastest first may not fit, the likeliest to fit come last)."""
    return ranked if host_ordered(ctx, ranked) else ranked[:MAX_EXACT_CANDIDATES]
