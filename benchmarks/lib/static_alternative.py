"""The best static setting of a non-pipeline alternative over a run (see :mod:`.static_common`).

Equal-group schedules (``ulysses-zero3`` over ``(sp_degree, 2^k)``, ``ring-cp`` over
``cp_degree``) try each setting of their ``static_grid``: every batch at its least checkpoint
count, then all at the run's largest.  A schedule that re-solves its groups every step
(``flexsp``) fixes only its checkpoint count and is tuned per batch at that count.
"""
from __future__ import annotations

from typing import Callable, Sequence

from benchmarks.lib.static_common import StaticResult, static_result
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.alternatives.round_plan import RoundPlan, simulate_rounds
from infinipipe_hf.planner.registry import ALTERNATIVES, SCHEDULES
from infinipipe_hf.planner.schedules.base import ROUNDS
from infinipipe_hf.planner.search.api import plan_rounds


def static_alternative(schedule: str, batches: Sequence[Sequence[int]], cost: FlatCost) -> StaticResult:
    """Best static setting of a non-pipeline alternative (``ulysses-zero3``, ``ring-cp``, ``flexsp``)."""
    batches = [[int(n) for n in b] for b in batches]
    sched = SCHEDULES.get(schedule)
    if sched is None or sched.kind != ROUNDS:
        raise ValueError(f"schedule={schedule!r} is not a non-pipeline alternative; use "
                         f"{', '.join(ALTERNATIVES[:-1])} or {ALTERNATIVES[-1]}")
    cost = cost.for_system(schedule)  # priced at the system's own whole-step efficiency
    if sched.regroups_every_step:
        best, tried, error = _over_checkpoint_counts(schedule, sched.static_checkpoint_counts(cost), batches, cost)
    else:
        best, tried, error = _over_settings(sched.static_grid(batches, cost), batches, cost)
    return static_result(schedule, batches, best, tried, error)


def _over_checkpoint_counts(schedule: str, counts: list[int], batches: list[list[int]], cost: FlatCost):
    best, tried, error = None, 0, None
    for c in counts:
        tried += 1
        results = [plan_rounds(schedule, b, cost, checkpointing=c) for b in batches]
        if not all(r.feasible for r in results):
            error = next(r.error for r in results if not r.feasible)
            continue
        times = [r.simulation.step_time_s for r in results]
        if best is None or sum(times) < best[0]:
            best = (sum(times), {"checkpoint_layers": c}, times)
    return best, tried, error


def _over_settings(settings: list[tuple[dict, Callable[[int, int | None], RoundPlan]]], batches: list[list[int]],
                   cost: FlatCost):
    best, tried, error = None, 0, None
    for knobs, build in settings:
        tried += 1
        got, err = _run_setting(batches, build, cost)
        if got is None:
            error = err
            continue
        total, run_c, times = got
        if best is None or total < best[0]:
            best = (total, {**knobs, "checkpoint_layers": run_c}, times)
    return best, tried, error


def _run_setting(batches, build, cost: FlatCost):
    """Total time of one setting: each batch at its least count, then all at the run's largest.
    ``build(i, checkpoint)`` plans batch ``i``."""
    first = []
    for i in range(len(batches)):
        try:
            first.append(build(i, None))
        except ValueError as exc:
            return None, str(exc)
    run_c = max(p.checkpoint_layers for p in first)
    times = []
    for i, plan in enumerate(first):
        if plan.checkpoint_layers != run_c:
            plan = build(i, run_c)
        sim = simulate_rounds(plan, cost)
        if not sim.feasible:
            return None, sim.error
        times.append(sim.step_time_s)
    return (sum(times), run_c, times), None
